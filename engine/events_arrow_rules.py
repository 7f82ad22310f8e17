"""The cross-field rules of :func:`engine.events.check_batch`, over one kind's checked columns
(:class:`Columns`) as numpy arrays: each rule gives the boolean array of rows that break it, and
the first such row is reported (:func:`engine.events_arrow_check.check_arrow_batch`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.events import EventError, Form, Outcome, Reason


@dataclass(slots=True)
class EnumColumn:
    """An enum column as dictionary codes: ``values[codes[i]]`` is row ``i``'s value (``valid``
    false: a null, whose code is 0 — every code indexes ``values``, or is 0 when it is empty)."""

    values: list[str]
    codes: np.ndarray
    valid: np.ndarray | None = None

    def equals(self, value: str) -> np.ndarray:
        """Rows whose value is ``value`` (a null is no value)."""
        if value not in self.values:
            return np.zeros(len(self.codes), dtype=bool)
        hit = self.codes == self.values.index(value)
        return hit if self.valid is None else hit & self.valid


@dataclass(slots=True)
class Columns:
    """One kind's rows after the column checks: number and flag columns as numpy arrays (nulls
    as 0), enums as :class:`EnumColumn`, the null masks of nullable columns, the Arrow arrays."""

    rows: int
    numbers: dict[str, np.ndarray] = field(default_factory=dict)
    enums: dict[str, EnumColumn] = field(default_factory=dict)
    nulls: dict[str, np.ndarray] = field(default_factory=dict)
    arrays: dict[str, pa.Array] = field(default_factory=dict)

    def null(self, name: str) -> np.ndarray:
        mask = self.nulls.get(name)
        return mask if mask is not None else np.zeros(self.rows, dtype=bool)


Rule = tuple[str, Callable[[Columns], np.ndarray], str]
"""(the column an error names, the rows that break the rule, the reason)."""


def _sync_delay_elsewhere(c: Columns) -> np.ndarray:
    delayed = (c.numbers["indexer_sync_delay_tokens"] != 0) | (c.numbers["indexer_sync_delay_seconds"] != 0)
    return delayed & ~c.enums["form"].equals(Form.INDEXER_STATE.value)


LOOKUP_RULES: tuple[Rule, ...] = (
    (
        "reason",
        lambda c: c.enums["outcome"].equals(Outcome.HIT.value) != c.enums["reason"].equals(Reason.NONE.value),
        "a hit carries reason none, and only a hit does",
    ),
    ("usable_tokens", lambda c: c.numbers["usable_tokens"] > c.numbers["hash_hit_tokens"], "exceeds hash_hit_tokens"),
    ("recoverable_tokens", lambda c: c.numbers["recoverable_tokens"] > c.numbers["usable_tokens"], "exceeds usable_tokens"),
    ("ghost_tokens", lambda c: c.numbers["ghost_tokens"] > c.numbers["hash_hit_tokens"], "exceeds hash_hit_tokens"),
    (
        "ghost_bytes",
        lambda c: c.null("ghost_bytes") != (c.numbers["ghost_tokens"] == 0),
        "ghost_bytes and a non-zero ghost_tokens go together",
    ),
    ("ghost_bytes", lambda c: ~c.null("ghost_bytes") & (c.numbers["ghost_bytes"] == 0), "must be > 0: a ghost point needs more memory"),
    (
        "ghost_tokens",
        lambda c: (c.numbers["ghost_tokens"] != 0) & (c.numbers["ghost_tokens"] <= c.numbers["usable_tokens"]),
        "must exceed usable_tokens",
    ),
    (
        "spare_bytes",
        lambda c: ~c.null("spare_bytes") & (c.numbers["usable_tokens"] == 0),
        "only a lookup with usable tokens has spare memory",
    ),
    ("indexer_sync_delay_tokens", _sync_delay_elsewhere, "only an indexer_state lookup has a sync delay"),
    (
        "indexer_sync_delay_seconds",
        lambda c: (c.numbers["indexer_sync_delay_tokens"] == 0) & (c.numbers["indexer_sync_delay_seconds"] != 0),
        "must be 0 while indexer_sync_delay_tokens is 0 (in sync)",
    ),
    (
        "indexer_sync_delay_tokens",
        lambda c: c.numbers["indexer_sync_delay_tokens"] > c.numbers["hash_hit_tokens"],
        "exceeds hash_hit_tokens",
    ),
)
"""``cache_lookup``: in the order :func:`engine.events.check_batch` tests them."""

REQUEST_RULES: tuple[Rule, ...] = (
    (
        "prompt_tokens",
        lambda c: c.numbers["recoverable_tokens"] + c.numbers["replayed_tokens"] + c.numbers["recomputed_tokens"] != c.numbers["prompt_tokens"],
        "recoverable + replayed + recomputed != prompt_tokens",
    ),
    ("recoverable_tokens", lambda c: c.numbers["recoverable_tokens"] > c.numbers["hash_hit_tokens"], "exceeds hash_hit_tokens"),
    ("resume_tokens", lambda c: c.numbers["resume_tokens"] >= np.maximum(c.numbers["prompt_tokens"], 1), "must be below prompt_tokens"),
)
"""``request``: the token split, then L* below the prompt (``limiting_forms``: :func:`check_limiting_forms`)."""

RULES: dict[str, tuple[Rule, ...]] = {"cache_lookup": LOOKUP_RULES, "request": REQUEST_RULES, "engine_stats": (), "block": ()}

_FORMS = tuple(f.value for f in Form)


def _raise_at(kind: str, column: str, row: int, reason: str) -> None:
    raise EventError(f"$.{kind}[{row}].{column}", reason, column=column, row=row)


def apply_rules(kind: str, columns: Columns) -> None:
    """Every cross-field rule of ``kind``.

    Raises:
        EventError: at the first row of the first rule broken.
    """
    for name, bad_rows, reason in RULES[kind]:
        bad = bad_rows(columns)
        if bad.any():
            _raise_at(kind, name, int(np.argmax(bad)), reason)
    if kind == "request":
        check_limiting_forms(columns)


def check_limiting_forms(columns: Columns) -> None:
    """Each non-empty ``limiting_forms`` contains ``limiting_form`` and names no form twice
    (forms as bits of a mask per row: a repeat leaves fewer bits than items). Its items were
    checked against :class:`~engine.events.Form` before.

    Raises:
        EventError: at the first row that breaks either.
    """
    forms = columns.arrays["limiting_forms"]
    flat = forms.flatten()
    if not len(flat):
        return
    lengths = np.asarray(pc.fill_null(pc.list_value_length(forms), 0), dtype=np.int64)
    codes = np.asarray(pc.index_in(flat, value_set=pa.array(_FORMS)), dtype=np.int64)
    named_enum = columns.enums["limiting_form"]  # its codes are in range, also on null rows
    to_form = np.array([_FORMS.index(v) if v in _FORMS else -2 for v in named_enum.values] + [-1], dtype=np.int64)
    named = to_form[named_enum.codes]
    if named_enum.valid is not None:
        named = np.where(named_enum.valid, named, -1)
    rows = np.flatnonzero(lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))[rows]
    parents = np.repeat(np.arange(len(lengths)), lengths)
    contains = np.logical_or.reduceat(codes == named[parents], starts)
    if not contains.all():
        _raise_at("request", "limiting_forms", int(rows[np.argmin(contains)]), "does not contain limiting_form")
    bits = np.bitwise_or.reduceat(np.left_shift(1, codes), starts)
    distinct = np.array([int(b).bit_count() for b in bits])
    repeated = distinct != lengths[rows]
    if repeated.any():
        _raise_at("request", "limiting_forms", int(rows[np.argmax(repeated)]), "names a form twice")
