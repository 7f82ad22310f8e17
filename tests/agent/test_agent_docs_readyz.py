"""docs/agent.md's ``/readyz`` row gives the database schema version the agent really reports."""

from __future__ import annotations

import re
from pathlib import Path

from agent.migrations import SCHEMA_VERSION

DOC = Path(__file__).resolve().parents[2] / "docs" / "agent.md"


def test_the_readyz_row_gives_the_current_schema_version() -> None:
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith("| `GET /readyz` |")]
    assert len(rows) == 1
    shown = re.findall(r'"schema_version": (\d+)', rows[0]) + re.findall(r"the last migration applied: (\d+) now", rows[0])
    assert len(shown) == 4
    assert set(shown) == {str(SCHEMA_VERSION)}
