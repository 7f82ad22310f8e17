"""Plain progress lines for output that is not a terminal (kvscope.progress)."""

from __future__ import annotations

import io
import time

from rich.console import Console

from kvscope.progress import ProgressLines, duration_text


def test_line_gives_count_rate_eta_and_detail() -> None:
    now = [100.0]
    lines = ProgressLines(Console(file=io.StringIO()), "replay", 200, detail=lambda: "recoverable 61.0%", clock=lambda: now[0])
    lines.started = 100.0
    now[0] = 120.0
    lines.update(40)
    assert lines.line() == "replay 40/200 requests (20 %), 2.00 requests/s, ETA 1m20s, 20s elapsed; recoverable 61.0%"
    lines.update(200)
    assert "200/200 requests (100 %)" in lines.line() and ", done," in lines.line()
    assert duration_text(3725) == "1h02m" and duration_text(59.4) == "59s"


def test_lines_come_on_the_interval_without_updates_and_once_at_the_end() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert not console.is_terminal
    with ProgressLines(console, "replay", 10, interval_seconds=0.2) as lines:
        lines.update(3)
        deadline = time.monotonic() + 10
        while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:  # no update needed: a stuck step still shows
            time.sleep(0.05)
        ticks = out.getvalue().count("\n")
        lines.update(10)
    text = out.getvalue().splitlines()
    assert ticks >= 2 and all(t.startswith("replay 3/10 requests (30 %)") for t in text[:ticks])
    assert text[-1].startswith("replay 10/10 requests (100 %)") and ", done," in text[-1]


def test_a_quick_step_without_final_line_prints_nothing() -> None:
    out = io.StringIO()
    with ProgressLines(Console(file=out), "alerts test", 5, unit="evaluation times", interval_seconds=60, final=False) as lines:
        lines.update(5)
    assert out.getvalue() == "" and lines.lines_printed == 0
