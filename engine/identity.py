"""Where an engine runs and what it is called: the device it resolves, its engine id and its run id.

Two names, for two lifetimes (docs/agent.md, "Engine identity"):

* the **engine id** names the engine across restarts — its Prometheus series, its rows, its
  batch ``seq`` numbering and its spool file keep it. :func:`derived_engine_id` makes the
  default the CLI uses (``HOST-MODEL``); :func:`check_engine_id` validates one a user gives.
* the **run id** (:func:`new_run_id`) is new at every process start; it travels on each event
  batch (``EventBatch.run_id``) and tells one run of an engine from the next.

Nothing here imports torch at module level (the CLI derives the engine id without it); only
:func:`resolve_device` needs it.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from pathlib import PurePath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ENGINE_ID_MAX_CHARS = 128
"""Longest engine id accepted: the agent takes 256 characters, and the id also names the
engine's spool file (``<engine id>.spool.offset.tmp`` must fit a 255-byte file name)."""
ENGINE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What an engine id may be: letters, digits, ``.``, ``_`` and ``-``, starting with a letter or a
digit — safe as a file name (no ``/``, no leading dot), a Prometheus label value and a SQL string."""
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._-]+")


def default_engine_id() -> str:
    """``host-pid-start``: unique per engine run (the start time, hex milliseconds, tells apart
    two runs that got the same pid). What :class:`engine.llm.LLM` uses when given no id; the
    CLI gives one (:func:`derived_engine_id`), stable across restarts."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns() // 1_000_000:x}"


def derived_engine_id(model: str, host: str | None = None) -> str:
    """``HOST-MODEL``: this host's name (``host``: another) and the model's — a preset name, or
    the last part of a model directory — lower-cased, every run of other characters than
    :data:`ENGINE_ID_PATTERN` allows made one ``-``, cut to :data:`ENGINE_ID_MAX_CHARS`. The same
    on every restart of the same model on the same host, so the engine keeps its series and its
    seqs; two engines of one model on one host at the same time need their own ``--engine-id``.

    >>> derived_engine_id("/models/Qwen3-8B/", host="GPU-node.1")
    'gpu-node.1-qwen3-8b'
    """
    name = PurePath(model).name or model
    raw = f"{host if host is not None else socket.gethostname()}-{name}".lower()
    cleaned = _NOT_ALLOWED.sub("-", raw).strip("-._")[:ENGINE_ID_MAX_CHARS].rstrip("-._")
    return cleaned or "engine"


def check_engine_id(engine_id: str) -> str:
    """``engine_id`` when it matches :data:`ENGINE_ID_PATTERN` and has at most
    :data:`ENGINE_ID_MAX_CHARS` characters.

    Raises:
        ValueError: naming the value and what is allowed.
    """
    if len(engine_id) > ENGINE_ID_MAX_CHARS or not ENGINE_ID_PATTERN.fullmatch(engine_id):
        raise ValueError(
            f"engine id {engine_id!r} is not allowed: use 1 to {ENGINE_ID_MAX_CHARS} letters, digits, '.', '_' "
            "or '-', starting with a letter or a digit"
        )
    return engine_id


def new_run_id() -> str:
    """A new run id: 32 hex digits, the first 12 the start time in milliseconds (so run ids sort
    by start time, as UUIDv7's do), the rest random."""
    return f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(10)}"


def resolve_device(device: str) -> torch.device:
    """``"auto"`` picks CUDA when present, else the CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
