"""Data shipped with kvscope so a fresh clone's demo runs without ``../shared``."""

from __future__ import annotations

from pathlib import Path

BUNDLED_TRACE_DIR = Path(__file__).resolve().parent / "weka_slice"


def bundled_trace() -> Path:
    """The default trace of ``kvscope up``: a slice of the weka agentic traces (see its
    PROVENANCE.md and LICENSE)."""
    return BUNDLED_TRACE_DIR / "traces"
