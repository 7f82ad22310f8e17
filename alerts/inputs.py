"""The query side of rule-file evaluation: :func:`collect_inputs` reads, for every rule, the
windowed inputs :func:`alerts.rule_eval.evaluate` needs, from the agent's store.

Windows end at ``now − lag`` (late events are allowed for by the ingest lag) and are half-open
``[start, end)`` on the events' ``ts``:

* ``recoverable_hit_rate_drop`` — per (engine, model) from ``requests``: Σ recoverable and
  Σ prompt tokens over the window, and over the baseline (the ``baseline_window`` before it, or
  the same window 24 h earlier). The trailing baseline of a series whose alert is pending or
  firing is **anchored**: it is the ``baseline_window`` before the window of the evaluation at
  which the condition turned true (``anchors``: the alert's ``active_since``), not the one before
  now — so an outage never fills its own baseline, and a resolve needs the rate back within the
  clear thresholds of the rate before the outage (:func:`anchored_baselines`);
* ``recoverable_hit_rate_below`` — the same sums over each burn window's long and short window;
* ``tp_rank_disagreement`` — per (engine, form, tp_rank) from ``cache_lookups``: the window's
  ``tp_disagree`` lookups (0 for a series seen in the hour before, so its alert can resolve);
* ``form_invalidation_spike`` — per (engine, form, reason) from ``cache_lookups``: the reason's
  invalidated lookups and the form's lookups, in the window and in the baseline before it;
* ``recovery_latency_high`` — per (engine, form, tier) from the ``cache_minute`` rollup (the
  whole minutes of the window, the minute its end falls in excluded): cumulative
  recovery-latency bucket counts and the number of recoveries (lookups recovered or replayed);
* ``engine_silent`` — per engine: seconds since its last stored batch; an engine silent for longer
  than ``lookback`` is retired (inactive: its alert resolves instead of firing forever);
  ``ingest_stalled`` — one series (no labels): seconds since the last stored batch
  of any engine (none before any batch was ever stored);
* ``expr`` rules — the named query or SQL, run read-only with the agent's row and time limits:
  the ``value`` column is the series' value, every other column a label.

How many queries rule inputs run at once: at most one per rule. The built-in kinds run on their
group's evaluation thread, which APScheduler never runs twice at once (``max_instances=1``); but
groups run concurrently, and an ``expr`` query answered as timed out (DuckDB could not stop it at
once, :mod:`agent.deadline`) goes on in its worker thread while the next evaluation starts. So
each rule's running ``expr`` query is tracked (:class:`RunningQueries`, released by
``run_read_query``'s ``on_done`` when the query has really ended), and while it runs the rule is
skipped with :class:`ExprError` (a rule failure) instead of starting another.

Peer: Prometheus's rule evaluation, where a rule's expression is queried at each evaluation time.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime

import pyarrow as pa

from agent import queries, sql
from agent.ingest import RECOVERING_SQL, RECOVERY_BUCKETS
from agent.migrations import bucket_column
from agent.store import Store, to_timestamp
from alerts.rule_eval import (
    AlertState,
    BurnInput,
    CountInput,
    Data,
    DropInput,
    LatencyInput,
    SeriesInput,
    ShareInput,
    SilenceInput,
    Status,
    Tokens,
)
from alerts.rulefile import (
    HitRateBelow,
    HitRateDrop,
    InvalidationSpike,
    NamedQueryExpr,
    RankDisagreement,
    RecoveryLatencyHigh,
    Rule,
    SilentFor,
)

DAY = 86_400.0
HOUR = 3_600.0


class ExprError(ValueError):
    """An expr rule's query cannot feed an alert (no ``value`` column, a failing query, its
    previous query still running)."""


class RunningQueries:
    """The ``expr`` rules whose query is running (by alert name): at most one each. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._started: dict[str, float] = {}

    def claim(self, alert: str) -> Callable[[], None]:
        """Mark ``alert``'s query as running; returns its release (idempotent; pass it as
        ``on_done``).

        Raises:
            ExprError: ``alert``'s previous query is still running (how long, in the message).
        """
        with self._lock:
            started = self._started.get(alert)
            if started is not None:
                raise ExprError(
                    f"rule {alert}: skipped: its previous query still runs ({self._clock() - started:.1f} s, past "
                    "its time limit; DuckDB ends it when its current function call returns)"
                )
            self._started[alert] = mine = self._clock()

        def release() -> None:
            with self._lock:
                if self._started.get(alert) == mine:
                    del self._started[alert]

        return release

    def running(self) -> frozenset[str]:
        """The alert names whose query is running now."""
        with self._lock:
            return frozenset(self._started)


def collect_inputs(
    store: Store,
    rules: Sequence[Rule],
    *,
    now: float,
    lag_seconds: float = 5.0,
    row_limit: int = 10_000,
    timeout_seconds: float = 10.0,
    running: RunningQueries | None = None,
    anchors: Mapping[str, Mapping[tuple[tuple[str, str], ...], float]] | None = None,
) -> Data:
    """Every rule's series inputs at ``now`` (unix seconds). ``running``: the rules' queries still
    running (the scheduler's, kept across evaluations); ``None``: a fresh one. ``anchors``: rule
    name → series → when its alert's condition turned true (unix seconds; pending or firing
    alerts), which anchors a trailing drop baseline there (:func:`anchored_baselines`).

    Raises:
        ExprError: an expr rule's query failed, returned no ``value`` column, or is still running
            from an earlier evaluation (the message names the rule).
        duckdb.Error, StoreClosedError: the store failed.
    """
    end = now - lag_seconds
    running = RunningQueries() if running is None else running
    data: dict[str, Mapping[tuple[tuple[str, str], ...], SeriesInput]] = {}
    for rule in rules:
        settings = rule.settings
        if rule.expr is not None:
            data[rule.alert] = _expr(store, rule, now, row_limit, timeout_seconds, running)
        elif isinstance(settings, HitRateDrop):
            start = end - settings.window
            if settings.baseline == "trailing":
                base = (start - settings.baseline_window, start)
            else:
                base = (start - DAY, end - DAY)
            current = _token_sums(store, start, end)
            baseline = _token_sums(store, *base)
            if settings.baseline == "trailing":
                baseline.update(anchored_baselines(store, settings, (anchors or {}).get(rule.alert, {}), lag_seconds))
            data[rule.alert] = {
                key: DropInput(current.get(key, Tokens(0, 0)), baseline.get(key, Tokens(0, 0)))
                for key in current.keys() | baseline.keys()
            }
        elif isinstance(settings, HitRateBelow):
            sums = [(_token_sums(store, end - w.long, end), _token_sums(store, end - w.short, end)) for w in settings.windows]
            keys = set().union(*(long.keys() | short.keys() for long, short in sums))
            empty = Tokens(0, 0)
            data[rule.alert] = {
                key: BurnInput(tuple((long.get(key, empty), short.get(key, empty)) for long, short in sums))
                for key in keys
            }
        elif isinstance(settings, InvalidationSpike):
            data[rule.alert] = _shares(store, end - settings.window, end, settings.baseline_window)
        elif isinstance(settings, RankDisagreement):
            data[rule.alert] = _disagreements(store, end - settings.window, end)
        elif isinstance(settings, RecoveryLatencyHigh):
            data[rule.alert] = _latency(store, end - settings.window, end)
        elif isinstance(settings, SilentFor):
            data[rule.alert] = _silence(store, now, settings.lookback, per_engine=rule.kind == "engine_silent")
        else:  # pragma: no cover - the loader admits nothing else
            raise AssertionError(f"rule {rule.alert}: nothing to collect for kind {rule.kind}")
    return data


def activation_anchors(states: Iterable[AlertState], alert: str) -> dict[tuple[tuple[str, str], ...], float]:
    """For ``collect_inputs``'s ``anchors``: series → ``active_since`` of ``alert``'s pending or
    firing alerts among ``states``."""
    live = (Status.PENDING, Status.FIRING)
    return {st.series: st.active_since for st in states if st.alert == alert and st.status in live and st.active_since is not None}


def anchored_baselines(
    store: Store, settings: HitRateDrop, anchors: Mapping[tuple[tuple[str, str], ...], float], lag_seconds: float
) -> dict[tuple[tuple[str, str], ...], Tokens]:
    """Per anchored series (labels → ``active_since``, unix seconds): its token sums over the
    ``baseline_window`` before the window evaluated at ``active_since`` — the baseline its alert
    fired against, kept while the alert is pending or firing. A series without requests there
    has an empty baseline (no data)."""
    out: dict[tuple[tuple[str, str], ...], Tokens] = {}
    for key, active_since in anchors.items():
        start = active_since - lag_seconds - settings.window
        out[key] = _token_sums(store, start - settings.baseline_window, start).get(key, Tokens(0, 0))
    return out


def _key(**labels: object) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, str(value)) for name, value in labels.items()))


def _token_sums(store: Store, start: float, end: float) -> dict[tuple[tuple[str, str], ...], Tokens]:
    with store.cursor() as cur:
        rows = cur.execute(
            """
            SELECT engine_id, model, sum(recoverable_tokens)::BIGINT, sum(prompt_tokens)::BIGINT
            FROM requests WHERE ts >= $start AND ts < $end GROUP BY ALL
            """,
            {"start": to_timestamp(start), "end": to_timestamp(end)},
        ).fetchall()
    return {_key(engine=e, model=m): Tokens(int(r), int(p)) for e, m, r, p in rows}


def _shares(store: Store, start: float, end: float, baseline_window: float) -> dict[tuple[tuple[str, str], ...], SeriesInput]:
    with store.cursor() as cur:
        rows = cur.execute(
            """
            WITH w AS (
                SELECT engine_id, form, reason, outcome, ts >= $start AS current
                FROM cache_lookups WHERE ts >= $base_start AND ts < $end
            ),
            forms AS (
                SELECT engine_id, form,
                       count(*) FILTER (WHERE current) AS n, count(*) FILTER (WHERE NOT current) AS base_n
                FROM w GROUP BY ALL
            ),
            reasons AS (
                SELECT engine_id, form, reason,
                       count(*) FILTER (WHERE current) AS n, count(*) FILTER (WHERE NOT current) AS base_n
                FROM w WHERE outcome = 'invalidated' GROUP BY ALL
            )
            SELECT r.engine_id, r.form, r.reason, r.n, f.n, r.base_n, f.base_n
            FROM reasons r JOIN forms f USING (engine_id, form)
            """,
            {
                "start": to_timestamp(start),
                "base_start": to_timestamp(start - baseline_window),
                "end": to_timestamp(end),
            },
        ).fetchall()
    return {
        _key(engine=e, form=f, reason=reason): ShareInput(int(n), int(fn), int(bn), int(bfn))
        for e, f, reason, n, fn, bn, bfn in rows
    }


def _disagreements(store: Store, start: float, end: float) -> dict[tuple[tuple[str, str], ...], SeriesInput]:
    """Per (engine, form, tp_rank) with a ``tp_disagree`` lookup in the hour before ``start`` or
    in the window: the window's count (0 once they stopped, so a firing alert resolves)."""
    with store.cursor() as cur:
        rows = cur.execute(
            """
            SELECT engine_id, form, tp_rank, (count(*) FILTER (WHERE ts >= $start))::BIGINT
            FROM cache_lookups WHERE reason = 'tp_disagree' AND ts >= $lookback AND ts < $end
            GROUP BY ALL
            """,
            {"start": to_timestamp(start), "lookback": to_timestamp(start - HOUR), "end": to_timestamp(end)},
        ).fetchall()
    return {_key(engine=e, form=f, tp_rank=r): CountInput(int(n)) for e, f, r, n in rows}


def _latency(store: Store, start: float, end: float) -> dict[tuple[tuple[str, str], ...], SeriesInput]:
    buckets = ", ".join(f"sum({bucket_column(b)})::BIGINT" for b in RECOVERY_BUCKETS)
    first_minute = to_timestamp(math.floor(start / 60) * 60)
    end_minute = to_timestamp(math.floor(end / 60) * 60)  # whole minutes before the window's end
    with store.cursor() as cur:
        rows = cur.execute(
            f"""
            SELECT engine_id, form, tier, {buckets},
                   (sum(lookups) FILTER (WHERE {RECOVERING_SQL}))::BIGINT
            FROM cache_minute WHERE minute >= $start AND minute < $end
            GROUP BY ALL HAVING sum(lookups) FILTER (WHERE {RECOVERING_SQL}) > 0
            """,
            {"start": first_minute, "end": end_minute},
        ).fetchall()
    return {
        _key(engine=e, form=f, tier=t): LatencyInput(tuple(RECOVERY_BUCKETS), tuple(int(c) for c in counts))
        for e, f, t, *counts in rows
    }


def _silence(store: Store, now: float, lookback: float, *, per_engine: bool) -> dict[tuple[tuple[str, str], ...], SeriesInput]:
    with store.cursor() as cur:
        if per_engine:
            rows = cur.execute(
                "SELECT engine_id, max(received_at) FROM ingest_batches WHERE status = 'stored' GROUP BY engine_id"
            ).fetchall()
        else:  # any stored batch ever: a stall older than the lookback still counts
            rows = cur.execute("SELECT NULL, max(received_at) FROM ingest_batches WHERE status = 'stored'").fetchall()
    out: dict[tuple[tuple[str, str], ...], SeriesInput] = {}
    for engine, last in rows:
        if last is None:
            continue
        assert isinstance(last, datetime)
        seconds = max(now - _unix(last), 0.0)
        if per_engine:  # an engine silent for longer than the lookback is retired, not alerting
            out[_key(engine=engine)] = SilenceInput(seconds, retired=seconds > lookback)
        else:
            out[()] = SilenceInput(seconds)
    return out


def _unix(moment: datetime) -> float:
    return (moment - datetime(1970, 1, 1)).total_seconds()


def _expr(
    store: Store, rule: Rule, now: float, row_limit: int, timeout_seconds: float, running: RunningQueries
) -> dict[tuple[tuple[str, str], ...], SeriesInput]:
    expr = rule.expr
    try:
        if isinstance(expr, NamedQueryExpr):
            query = queries.get_query(expr.query)
            text, params = query.sql, query.bind(expr.params, now=to_timestamp(now))
        else:
            assert expr is not None
            text, params = expr.sql, None
        # run_read_query calls on_done exactly once, when the query has really ended
        done = running.claim(rule.alert)
        result = sql.run_read_query(store, text, params, row_limit=row_limit, timeout_seconds=timeout_seconds, on_done=done)
    except (sql.SqlError, queries.QueryError) as exc:
        raise ExprError(f"rule {rule.alert}: its query failed: {exc.reason}") from None
    if "value" not in result.columns:
        raise ExprError(f"rule {rule.alert}: its query returns no value column (columns: {', '.join(result.columns)})")
    if result.truncated:
        raise ExprError(
            f"rule {rule.alert}: its query returned more than {row_limit} rows; narrow it (a missing "
            "series would read as resolved)"
        )
    table: pa.Table = result.table
    labels = [c for c in result.columns if c != "value"]
    out: dict[tuple[tuple[str, str], ...], SeriesInput] = {}
    for row in table.to_pylist():
        value = row["value"]
        key = _key(**{c: row[c] for c in labels})
        if value is None:
            out[key] = None
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ExprError(
                f"rule {rule.alert}: its value column must be numeric, got {type(value).__name__} {value!r}"
            ) from None
        out[key] = number if math.isfinite(number) else None  # NaN or ±Inf: no data
    return out
