"""A trace replay as ``kvscope up`` and ``kvscope replay`` run it: the engine with telemetry to an
agent (optional), a progress bar, and the summary — read back from the agent when there is one,
so it shows what was stored, and checked against the engine's own tally so a loss is noticed."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agent.client import AgentClient, AgentError
from engine.cache import CacheConfig
from engine.config import HybridConfig
from engine.events import Form
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.runtime.engine_thread import EngineThread
from engine.telemetry import TelemetryClient
from engine.trace.formats import TraceRequest
from engine.trace.replay import ReplayConfig, ReplayTally, replay
from kvscope.progress import ProgressLines
from kvscope.summary import Summary


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayRun:
    """What a replay did: the in-process tally and the events the agent never stored."""

    engine_id: str
    tally: ReplayTally
    lost_events: int
    run_id: str | None = None
    """The run id the events carried (None without an agent): the summary is read back for it."""


class _RollingRate:
    """Recoverable and raw hit rate over the last ``n`` requests (token sums)."""

    def __init__(self, n: int = 50) -> None:
        self._rows: deque[tuple[int, int, int]] = deque(maxlen=n)

    def add(self, out: RequestOutput) -> None:
        c = out.cache
        self._rows.append((c.prompt_tokens, c.hash_hit_tokens, c.recoverable_tokens))

    def text(self) -> str:
        rows = list(self._rows)  # one copy: the progress lines read it from their own thread
        prompt = sum(r[0] for r in rows)
        if not prompt:
            return ""
        raw = sum(r[1] for r in rows) / prompt
        rec = sum(r[2] for r in rows) / prompt
        return f"last {len(rows)} requests: recoverable {100 * rec:5.1f}% (raw {100 * raw:5.1f}%)"


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSqueeze:
    """A drill: from ``start_seconds`` after the replay began, for ``duration_seconds``, the
    ``swa_window`` pool keeps at most ``max_cached_blocks`` cached pages (evictions start, the
    windows behind cached prefixes are lost, the recoverable hit rate drops); then the cap is
    lifted and the cache refills. Checked after every request."""

    start_seconds: float
    duration_seconds: float
    max_cached_blocks: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_seconds) and math.isfinite(self.duration_seconds)):
            raise ValueError("START and DURATION must be finite seconds")
        if not (self.start_seconds >= 0 and self.duration_seconds > 0 and self.max_cached_blocks >= 0):
            raise ValueError("a squeeze needs START >= 0 and DURATION > 0 seconds")

    @classmethod
    def parse(cls, text: str) -> PoolSqueeze:
        """``START:DURATION`` in seconds, e.g. ``60:90``.

        Raises:
            ValueError: not two numbers, or out of range.
        """
        start, sep, duration = text.partition(":")
        try:
            if not sep:
                raise ValueError
            values = float(start), float(duration)
        except ValueError:
            raise ValueError(f"{text!r} is not START:DURATION in seconds (such as 60:90)") from None
        try:
            return cls(start_seconds=values[0], duration_seconds=values[1])
        except ValueError as exc:
            raise ValueError(f"{text!r}: {exc}") from None


@contextlib.contextmanager
def _progress(console: Console, total: int, rolling: _RollingRate) -> Iterator[Callable[[int], None]]:
    """``show(done)``: a rich bar on a terminal, else a plain line every 10 s (:mod:`kvscope.progress`)."""
    if not console.is_terminal:
        with ProgressLines(console, "replay", total, detail=rolling.text) as lines:
            yield lines.update
        return
    columns = (
        TextColumn("[bold]replay[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("replay", total=total, rate="")
        yield lambda done: progress.update(task, completed=done, rate=rolling.text())


def drain_earlier_spools(spool_dir: Path, agent_url: str, *, current_engine_id: str, timeout_seconds: float = 30.0) -> int:
    """Send what the spools earlier runs left in ``spool_dir`` still hold — batches never sent,
    or acknowledged but not yet durable when the run ended — each under its own engine id (the
    file's stem), and remove the files of every spool left empty. Returns the events sent.
    ``current_engine_id``'s spool is the running engine's own and is left alone."""
    sent = 0
    for path in sorted(spool_dir.glob("*.spool")) if spool_dir.is_dir() else []:
        engine_id = path.stem
        if engine_id == current_engine_id:
            continue
        if path.stat().st_size:
            client = TelemetryClient(agent_url, engine_id, spool_path=path)
            client.close(timeout_seconds)
            sent += client.replayed_events + client.resent_events
        if path.stat().st_size == 0:
            for leftover in (path, path.with_name(path.name + ".offset"), path.with_name(path.name + ".seq")):
                leftover.unlink(missing_ok=True)
    return sent


def run_replay(
    *,
    model: str | HybridConfig,
    cache: CacheConfig,
    config: ReplayConfig,
    requests: Sequence[TraceRequest],
    agent_url: str | None,
    engine_id: str,
    console: Console,
    stop: threading.Event | None = None,
    spool_dir: Path | None = None,
    squeeze: PoolSqueeze | None = None,
    on_squeeze: Callable[[bool, float], None] | None = None,
) -> ReplayRun:
    """Replay ``requests`` through a fresh engine, showing progress on ``console``.

    With ``agent_url`` the engine's events go to that agent (through a spool file under
    ``spool_dir`` while the agent cannot take them); the telemetry is flushed before this
    returns, and ``lost_events`` counts the events dropped or rejected on the way.

    With ``squeeze`` the ``swa_window`` pool is squeezed for a while (:class:`PoolSqueeze`);
    ``on_squeeze(squeezed, unix_time)`` is called when the squeeze begins and when it ends.

    Raises:
        ValueError: an unknown model or a cache configuration the model cannot use, or a squeeze
            of a model without a ``swa_window`` pool.
    """
    sink: TelemetryClient | None = None
    if agent_url is not None:  # events the agent cannot take yet wait in <spool_dir>/<engine id>.spool
        spool = spool_dir / f"{engine_id}.spool" if spool_dir is not None else None
        sink = TelemetryClient(agent_url, engine_id, spool_path=spool)
    engine = EngineThread()  # the model is built, stepped and closed on one thread (engine_thread's docstring)
    try:
        llm = engine.run(LLM, model, cache=cache, telemetry=sink, engine_id=engine_id)
    except BaseException:
        engine.close()
        raise
    if squeeze is not None and not any(f.form is Form.SWA_WINDOW for f in llm.cache.kv_forms):
        engine.run(llm.close, timeout_seconds=60)
        engine.close()
        raise ValueError("--squeeze-window-pool needs a model with sliding-window layers (a swa_window pool)")
    console.print(llm.cache.memory_plan().render(), markup=False, highlight=False)
    started = time.monotonic()
    squeezed = False
    total = min(len(requests), config.max_requests or len(requests))
    rolling = _RollingRate()
    try:
        with _progress(console, total, rolling) as show:

            def on_request(done: int, _total: int, _req: TraceRequest, out: RequestOutput | None) -> None:
                nonlocal squeezed
                if out is not None:
                    rolling.add(out)
                if squeeze is not None:
                    elapsed = time.monotonic() - started
                    due = squeeze.start_seconds <= elapsed < squeeze.start_seconds + squeeze.duration_seconds
                    if due != squeezed:
                        squeezed = due
                        evicted = llm.cache.limit_cached(Form.SWA_WINDOW, squeeze.max_cached_blocks if due else None)
                        what = f"squeezed to {squeeze.max_cached_blocks} cached pages ({evicted} evicted)" if due else "released"
                        clock = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
                        console.print(f"swa_window pool {what} at {elapsed:.0f} s ({clock})")
                        if on_squeeze is not None:
                            on_squeeze(due, time.time())
                show(done)

            tally = replay(llm, requests, config, on_request=on_request, stop=stop, thread=engine)
        engine.run(llm.emit_engine_stats)
    finally:
        if engine.alive:
            engine.run(llm.close, timeout_seconds=60)
            engine.close()
    lost = llm.sink.lost_events if isinstance(llm.sink, TelemetryClient) else 0
    if lost:
        console.print(f"[red]telemetry lost {lost} events: the agent did not store them (see its log)[/]")
    return ReplayRun(engine_id=engine_id, tally=tally, lost_events=lost, run_id=sink.run_id if sink is not None else None)


def stored_summary(agent_url: str, run: ReplayRun, console: Console) -> tuple[Summary | None, bool]:
    """The summary of ``run`` as the agent stored it, and whether it matches the engine's tally.

    Returns ``(None, False)`` (after printing why) when the agent cannot answer.
    """
    try:
        stored = Summary.from_agent(AgentClient(base_url=agent_url, timeout_seconds=60), run.engine_id, run.run_id)
    except AgentError as exc:
        console.print(f"[red]cannot read the summary back from the agent: {exc}[/]")
        return None, False
    local = Summary.from_tally(run.tally)
    if stored.to_json() != local.to_json():
        console.print(
            "[red]the agent stored different totals than the engine counted "
            f"(stored {stored.requests} requests, engine {local.requests}); see the agent log[/]"
        )
        return stored, False
    return stored, True
