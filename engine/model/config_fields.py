"""Reading a model's ``config.json`` mapping into a config dataclass: the keyword arguments by
field name, checked against each field's JSON type. Shared by every family's config
(:mod:`engine.config`, :mod:`engine.model.deepseek_v4_config`, :mod:`engine.model.qwen3_next_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

HF_BOOKKEEPING_KEYS = frozenset({"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"})
"""config.json keys written by tools that carry no model information."""


def config_fields_from_dict(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of dataclass ``cls`` found in ``raw`` (a config.json mapping).

    Lists become tuples where the field is a tuple. Bookkeeping keys are ignored.

    Raises:
        ValueError: an unknown key, or a value of the wrong JSON type, naming the field.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in HF_BOOKKEEPING_KEYS:
            continue
        if key not in fields:
            raise ValueError(f"unknown field {key!r} for {cls.__name__}")
        default = fields[key].default
        if isinstance(default, tuple):
            if not isinstance(value, list | tuple):
                raise ValueError(f"field {key!r} must be a list, got {value!r:.60}")
            value = tuple(value)
        elif isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"field {key!r} must be true or false, got {value!r:.60}")
        elif isinstance(default, int) and not isinstance(default, bool) and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"field {key!r} must be an integer, got {value!r:.60}")
        elif isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"field {key!r} must be a number, got {value!r:.60}")
        elif isinstance(default, str) and not isinstance(value, str):
            raise ValueError(f"field {key!r} must be a string, got {value!r:.60}")
        out[key] = float(value) if isinstance(default, float) else value
    return out
