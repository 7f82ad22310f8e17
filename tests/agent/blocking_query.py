"""A query that runs exactly as long as a test wants: ``SELECT kvscope_block(1)`` calls a Python
function (a DuckDB UDF) that waits on an event. DuckDB cannot interrupt a query inside one
function call — as with ``repeat('x', 10^9)``, the case :mod:`agent.deadline` answers at the
limit — so it is that case, ended by the test instead of by the CPU's speed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.store import Store

BLOCKING_SQL = "SELECT kvscope_block(1) AS n"
WAIT_SECONDS = 60.0
"""The longest the function waits when a test never releases it (a failed test ends anyway)."""


@dataclass
class BlockingQuery:
    """``entered`` is set when DuckDB called the function; :meth:`release` lets it return."""

    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    function: Callable[[int], int] | None = None

    def release(self) -> None:
        self.released.set()

    def wait_entered(self) -> None:
        assert self.entered.wait(WAIT_SECONDS), "the blocking query never started"


def install_blocking_query(store: Store) -> BlockingQuery:
    """Register ``kvscope_block(BIGINT) -> BIGINT`` on ``store``'s database (every cursor sees
    it) and return its controls."""
    control = BlockingQuery()

    def block(x: int) -> int:
        control.entered.set()
        control.released.wait(WAIT_SECONDS)
        return x

    control.function = block  # DuckDB keeps no reference of its own once the cursor is closed
    with store.cursor() as cur:
        cur.create_function("kvscope_block", block, ["BIGINT"], "BIGINT")
    return control
