"""The alert drill, sized to this machine: ``kvscope up --drill``.

A fixed drill (second-scale rules and a squeeze at fixed wall seconds) fails on a loaded machine:
the replay slows, a 10 s window holds one or two requests, the rule's volume floor is never met
and nothing pages. So the drill is derived from the rate the replay runs at here and now:

1. :func:`calibrate` replays the trace's first requests in-process (no agent, a cache of its
   own) for at most ``seconds`` and measures the serving seconds per request (waits for
   arrivals left out) and prompt tokens per request;
2. :meth:`DrillPlan.derive` sizes the drop rule from that, assumed to run twice as slow during
   the drill (``slowdown``), or at the replay's longest wait between arrivals if that is longer:
   the window holds at least :data:`REQUESTS_PER_WINDOW` requests at that pace, the volume floor is about two requests' prompt tokens, the baseline is
   :data:`BASELINE_WINDOWS` windows, the evaluation interval a tenth of the window; the squeeze
   starts once one baseline and one window of traffic are in (the cache warm) and lasts three
   windows plus the rule's ``for`` and two intervals, so the window is squeezed all through,
   with a window to spare for telemetry and evaluation lag, before it ends;
3. :class:`DrillWatch` follows the rule's transitions in the agent (``alerts`` table, through
   ``POST /v1/sql``), times the page from the squeeze's start and the resolve from its release,
   and ends the replay once the alert has resolved (or the deadline after the release passed).

The rule is the shipped kind (``recoverable_hit_rate_drop``, trailing baseline, anchored while
active), so a resolve still needs the rate back near the rate before the squeeze.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import alerts
from agent.client import AgentClient, AgentError
from engine.cache import CacheConfig
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.runtime.engine_thread import EngineThread
from engine.trace.formats import TraceRequest
from engine.trace.replay import ReplayConfig, replay
from kvscope.replaying import PoolSqueeze

ALERT = "RecoverableHitRateDrop"
DRILL_NOTIFY_PATH = Path(alerts.__file__).with_name("examples") / "drill_notify.yaml"
"""The drill's default notification file: every page and resolve to ``notifications.jsonl``."""
REQUESTS_PER_WINDOW = 5
"""Requests the rule's window holds at the slowed rate."""
BASELINE_WINDOWS = 3
MIN_WINDOW_SECONDS = 10
MAX_WINDOW_SECONDS = 300


@dataclass(frozen=True, slots=True)
class Calibration:
    """What the calibration replay measured over its requests after the first (which pays the
    engine's warm-up): ``requests`` of them, ``compute_seconds`` of wall time spent serving them
    (the replay's waits between arrivals left out) and their mean prompt tokens."""

    requests: int
    compute_seconds: float
    prompt_tokens_per_request: float

    @property
    def seconds_per_request(self) -> float:
        return self.compute_seconds / self.requests


def calibrate(
    *, model: str, cache: CacheConfig, config: ReplayConfig, requests: Sequence[TraceRequest], seconds: float = 20.0, max_requests: int = 16
) -> Calibration:
    """Replay the first requests through a fresh engine without telemetry for at most
    ``seconds`` (wall) or ``max_requests`` requests, paced as the drill's replay will be, and
    time the serving apart from the waits for arrivals.

    Raises:
        ValueError: fewer than three requests were replayed (nothing to measure a rate from).
    """
    engine = EngineThread("kvscope-calibration")  # as the replay's engine: built and stepped on one thread
    try:
        llm = engine.run(LLM, model, cache=cache, engine_id="drill-calibration")
    except BaseException:
        engine.close()
        raise
    stop = threading.Event()
    started = time.monotonic()
    done: list[tuple[float, float, int]] = []  # (finished at, seconds slept so far, prompt tokens)
    slept = [0.0]

    def sleep(wait: float) -> None:
        slept[0] += wait
        time.sleep(wait)

    def on_request(_done: int, _total: int, _req: TraceRequest, out: RequestOutput | None) -> None:
        now = time.monotonic()
        if out is not None:
            done.append((now, slept[0], out.cache.prompt_tokens))
        if now - started >= seconds:
            stop.set()

    try:
        replay(llm, requests, ReplayConfig(**{**_fields(config), "max_requests": max_requests}), on_request=on_request, stop=stop, sleep=sleep, thread=engine)
    finally:
        engine.run(llm.close, timeout_seconds=10)
        engine.close()
    if len(done) < 3:
        raise ValueError(f"the drill's calibration replayed {len(done)} requests in {seconds:.0f} s: the machine is too slow for a drill")
    (first_at, first_slept, _), measured = done[0], done[1:]
    last_at, last_slept, _ = measured[-1]
    return Calibration(
        requests=len(measured),
        compute_seconds=max(1e-6, (last_at - first_at) - (last_slept - first_slept)),
        prompt_tokens_per_request=sum(tokens for _, _, tokens in measured) / len(measured),
    )


def _fields(config: ReplayConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in ReplayConfig.__dataclass_fields__}


@dataclass(frozen=True, slots=True, kw_only=True)
class DrillPlan:
    """The drill's rule and squeeze, in whole seconds (see the module docstring for the sizing)."""

    calibration: Calibration
    window_seconds: int
    baseline_seconds: int
    interval_seconds: int
    for_seconds: int
    min_prompt_tokens: int
    squeeze: PoolSqueeze

    @classmethod
    def derive(cls, calibration: Calibration, *, max_wait_seconds: float, slowdown: float = 2.0) -> DrillPlan:
        """Size the drill for requests that take ``calibration``'s serving time times
        ``slowdown``, or the replay's longest wait between arrivals (``max_wait_seconds``) if
        that is longer: the slowest the replay can go unless the machine slows further.

        Raises:
            ValueError: the window it needs exceeds :data:`MAX_WINDOW_SECONDS`.
        """
        per_request = max(calibration.seconds_per_request * slowdown, max_wait_seconds)
        window = max(MIN_WINDOW_SECONDS, math.ceil(REQUESTS_PER_WINDOW * per_request))
        if window > MAX_WINDOW_SECONDS:
            raise ValueError(
                f"this machine serves a request in {calibration.seconds_per_request:.1f} s: a drill window would need "
                f"{window} s (over {MAX_WINDOW_SECONDS} s); free the machine or use a smaller --model"
            )
        interval = max(1, window // 10)
        for_seconds = 2 * interval
        baseline = BASELINE_WINDOWS * window
        return cls(
            calibration=calibration,
            window_seconds=window,
            baseline_seconds=baseline,
            interval_seconds=interval,
            for_seconds=for_seconds,
            min_prompt_tokens=max(1, round(2 * calibration.prompt_tokens_per_request)),
            squeeze=PoolSqueeze(start_seconds=baseline + window, duration_seconds=3 * window + for_seconds + 2 * interval),
        )

    @property
    def resolve_deadline_seconds(self) -> float:
        """Seconds after the release the drill waits for the resolve."""
        return 4.0 * self.window_seconds + self.baseline_seconds + 30.0

    def rule_file(self) -> dict[str, Any]:
        """The drill's rule file (the format of ``alerts/default_rules.yaml``)."""
        rule = {
            "alert": ALERT,
            "kind": "recoverable_hit_rate_drop",
            "window": f"{self.window_seconds}s",
            "baseline": "trailing",
            "baseline_window": f"{self.baseline_seconds}s",
            "fire_relative_drop": 0.7,
            "fire_absolute_drop": 0.4,
            "clear_relative_drop": 0.3,
            "clear_absolute_drop": 0.2,
            "min_prompt_tokens": self.min_prompt_tokens,
            "for": f"{self.for_seconds}s",
            "keep_firing_for": f"{self.for_seconds}s",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "Recoverable hit rate on {{ $labels.engine }} fell to {{ $value | humanizePercentage }}",
                "description": "The drill squeezed the swa_window pool: no resume point keeps its sliding window.",
            },
        }
        return {"groups": [{"name": "drill", "interval": f"{self.interval_seconds}s", "rules": [rule]}]}

    def rule_file_text(self) -> str:
        header = f"# Written by kvscope up --drill for this machine's rate: {self.describe()}\n"
        return header + yaml.safe_dump(self.rule_file(), sort_keys=False)

    def describe(self) -> str:
        c = self.calibration
        return (
            f"{c.seconds_per_request:.2f} s per request, {c.prompt_tokens_per_request:,.0f} prompt tokens each → window "
            f"{self.window_seconds} s, baseline {self.baseline_seconds} s, floor {self.min_prompt_tokens:,} tokens, "
            f"every {self.interval_seconds} s, for {self.for_seconds} s; squeeze from {self.squeeze.start_seconds:.0f} s "
            f"for {self.squeeze.duration_seconds:.0f} s"
        )

    def to_json(self) -> dict[str, Any]:
        c = self.calibration
        return {
            "seconds_per_request": round(c.seconds_per_request, 4),
            "prompt_tokens_per_request": round(c.prompt_tokens_per_request, 1),
            "window_seconds": self.window_seconds,
            "baseline_seconds": self.baseline_seconds,
            "interval_seconds": self.interval_seconds,
            "for_seconds": self.for_seconds,
            "min_prompt_tokens": self.min_prompt_tokens,
            "squeeze_start_seconds": self.squeeze.start_seconds,
            "squeeze_duration_seconds": self.squeeze.duration_seconds,
        }


@dataclass(slots=True)
class DrillWatch:
    """Follows the drill's alert in the agent and ends the replay (``stop``) once it resolved
    after the release, or :attr:`DrillPlan.resolve_deadline_seconds` after the release.

    Unix times: ``squeezed_at`` / ``released_at`` from :meth:`on_squeeze`, ``fired_at`` /
    ``resolved_at`` from the agent's ``alerts`` table (the evaluation that made the transition).
    """

    plan: DrillPlan
    client: AgentClient
    stop: threading.Event
    squeezed_at: float | None = None
    released_at: float | None = None
    fired_at: float | None = None
    resolved_at: float | None = None
    errors: list[str] = field(default_factory=list)
    ended_replay: bool = False
    """Whether the watch (not a signal) ended the replay."""
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def on_squeeze(self, squeezed: bool, at: float) -> None:
        if squeezed:
            self.squeezed_at = at
        else:
            self.released_at = at

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="drill-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._done.wait(self.plan.interval_seconds):
            self.poll()
            if self.released_at is not None and (
                self.resolved_at is not None or time.time() > self.released_at + self.plan.resolve_deadline_seconds
            ):
                time.sleep(2 * self.plan.interval_seconds)  # a second page or resolve would show now
                self.poll()
                self.ended_replay = True
                self.stop.set()
                return

    def poll(self) -> None:
        """Read the alert's first firing after the squeeze began and the first resolve after it."""
        if self.squeezed_at is None:
            return
        try:
            rows = self.client.sql(
                f"SELECT state, epoch(ts) FROM alerts WHERE alert = '{ALERT}' AND event = 'transition' AND epoch(ts) >= {self.squeezed_at - 1:.3f} ORDER BY ts"
            ).json()["rows"]
        except (AgentError, KeyError, ValueError) as exc:
            if str(exc) not in self.errors:
                self.errors.append(str(exc))
            return
        fired = [float(at) for state, at in rows if state == "firing"]
        self.fired_at = fired[0] if fired else None
        resolved = [float(at) for state, at in rows if state == "resolved" and fired and float(at) > fired[0]]
        self.resolved_at = resolved[0] if resolved else None

    @property
    def paged(self) -> bool:
        return self.fired_at is not None and self.released_at is not None and self.fired_at <= self.released_at

    def verdict(self) -> str | None:
        """Why the drill failed, or None when it paged during the squeeze and resolved after."""
        if self.squeezed_at is None:
            return "the replay ended before the squeeze began (raise --max-requests)"
        if self.fired_at is None:
            return "no page: the alert never fired (see the Alerts page's Rules panel or the agent log for 'no data')"
        if not self.paged:
            return "the alert fired only after the pool was released"
        if self.resolved_at is None:
            return "the alert paged but never resolved before the drill's deadline"
        return None

    def to_json(self) -> dict[str, Any]:
        def since(a: float | None, b: float | None) -> float | None:
            return round(a - b, 3) if a is not None and b is not None else None

        return {
            "plan": self.plan.to_json(),
            "squeezed_at": self.squeezed_at,
            "released_at": self.released_at,
            "fired_at": self.fired_at,
            "resolved_at": self.resolved_at,
            "detection_seconds": since(self.fired_at, self.squeezed_at),
            "resolve_seconds": since(self.resolved_at, self.released_at),
            "failure": self.verdict(),
        }
