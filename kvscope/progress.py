"""Progress for long commands whose output is not a terminal: one plain line at a fixed interval.

A rich progress bar draws nothing until the end when its console is a pipe or a log file, so
``kvscope up``, ``kvscope replay`` and ``kvscope replay --server`` print, instead, a line like ::

    replay 37/200 requests (18 %), 1.92 requests/s, ETA 1m25s; last 50 requests: recoverable 61.0% (raw 64.2%)

every ``interval_seconds`` (default 10) on an APScheduler background job — also while a long
request holds the engine, so a silent log means a stuck process — and once more when done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from apscheduler.schedulers.background import BackgroundScheduler
from rich.console import Console

logging.getLogger("apscheduler").setLevel(logging.WARNING)  # not a line per job run with -v: the progress line is the output

INTERVAL_SECONDS = 10.0
"""Seconds between two progress lines."""


def duration_text(seconds: float) -> str:
    """``"42s"``, ``"3m05s"`` or ``"1h02m"``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressLines:
    """Plain progress lines: ``what done/total unit (pct), rate, ETA; detail``.

    Args:
        console: where the lines go (the command's stderr console).
        what: the step's name (``"replay"``).
        total: how many items the step will do (the ETA assumes the rate so far holds).
        unit: what an item is (``"requests"``).
        interval_seconds: seconds between two lines.
        detail: extra text for each line (a rolling hit rate), read when the line is printed.
        final: print a last line when done even if the step was quick (False: only after an
            interval line, so a fast command's stderr stays empty).
        clock: monotonic seconds (tests).
    """

    def __init__(
        self, console: Console, what: str, total: int, *, unit: str = "requests", interval_seconds: float = INTERVAL_SECONDS,
        detail: Callable[[], str] | None = None, final: bool = True, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.console = console
        self.what = what
        self.total = total
        self.unit = unit
        self.interval_seconds = interval_seconds
        self.detail = detail
        self.clock = clock
        self.final = final
        self.lines_printed = 0
        self.done = 0
        self.started = clock()
        self._lock = threading.Lock()
        self._scheduler: BackgroundScheduler | None = None

    def line(self) -> str:
        """The line for the progress now."""
        elapsed = self.clock() - self.started
        done, total = self.done, self.total
        pct = f" ({100 * done // total} %)" if total else ""
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"ETA {duration_text((total - done) / rate)}" if rate > 0 and done < total else ("done" if done >= total else "ETA unknown")
        text = f"{self.what} {done}/{total} {self.unit}{pct}, {rate:.2f} {self.unit}/s, {eta}, {duration_text(elapsed)} elapsed"
        extra = self.detail() if self.detail is not None else ""
        return f"{text}; {extra}" if extra else text

    def print_line(self) -> None:
        with self._lock:
            self.console.print(self.line(), markup=False, highlight=False)
            self.lines_printed += 1

    def update(self, done: int) -> None:
        """``done`` items are finished."""
        self.done = done

    def __enter__(self) -> ProgressLines:
        self.started = self.clock()
        self._scheduler = BackgroundScheduler(daemon=True)
        self._scheduler.add_job(self.print_line, "interval", seconds=self.interval_seconds, max_instances=1, coalesce=True, misfire_grace_time=None)
        self._scheduler.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        if exc_type is None and (self.final or self.lines_printed):
            self.print_line()
