"""Where a run's batch seqs start: an engine keeps its id across restarts, so each run continues
the seqs of the one before instead of reusing them (the agent is idempotent on (engine id, seq):
a reused seq with other events is a 409 conflict, and a jump past seqs never sent is a gap).

The telemetry client (:mod:`engine.telemetry`) asks :func:`first_seq` once, before its run's
first batch. It takes the larger of

* the spool's saved next seq (``<spool>.seq``, :attr:`engine.spool.Spool.next_seq`), which also
  counts batches still waiting in the spool unsent, and
* the agent's next expected seq for the engine id (``GET /v1/ingest/next-seq``: one above the
  highest seq it received, stored or rejected — a restarted engine whose spool was lost, or that
  has none, continues there).

An unreachable agent is not waited for when there is a spool (its saved seq continues); without
one no batch can be sent anyway, so the client asks again before its next batch.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

log = logging.getLogger(__name__)


def fetch_next_seq(http: httpx.Client, url: str, engine_id: str, attempts: int, stop: threading.Event) -> int | None:
    """``GET url?engine_id=`` (the agent's ``/v1/ingest/next-seq``): the seq the agent expects
    next from ``engine_id``, 0 for an engine it never heard of. 0 too when the agent does not say
    (an older agent's 404, an answer without ``next_seq``, one that cannot be read): the caller
    keeps its own count then. None when the agent cannot be reached (connection errors, 5xx) in
    ``attempts`` tries; the backoff doubles from 0.1 s up to 2 s and stops once ``stop`` is set."""
    delay = 0.1
    for attempt in range(1, attempts + 1):
        try:
            resp = http.get(url, params={"engine_id": engine_id})
        except httpx.TransportError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # an answer that is not the agent's: it does not say
            log.warning("telemetry next seq %s: unreadable answer (%s); keeping the local count", url, exc)
            return 0
        else:
            if resp.status_code < 500:
                try:
                    answer = resp.json() if resp.status_code == 200 else None
                except ValueError:
                    answer = None
                value = answer.get("next_seq") if isinstance(answer, dict) else None
                return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
            reason = f"HTTP {resp.status_code}"
        if attempt < attempts and not stop.is_set():
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        log.warning("telemetry next seq %s attempt %d failed: %s", url, attempt, reason)
    return None


def first_seq(
    http: httpx.Client, events_url: str, engine_id: str, *, spool_next_seq: int | None, attempts: int, stop: threading.Event
) -> int | None:
    """The first seq of this run: max(``spool_next_seq``, the agent's next expected seq), asked
    at the agent beside ``events_url`` (``.../v1/events``). With a spool (``spool_next_seq`` not
    None) the agent is tried once and an unreachable one leaves the spool's seq; without one it
    is tried ``attempts`` times and None says it could not be reached."""
    url = events_url.rsplit("/", 1)[0] + "/ingest/next-seq"
    local = spool_next_seq if spool_next_seq is not None else 0
    expected = fetch_next_seq(http, url, engine_id, 1 if spool_next_seq is not None else attempts, stop)
    if expected is None:
        return None if spool_next_seq is None else local
    if expected > local:
        log.info("telemetry: engine %s continues at the agent's next seq %d (local count %d)", engine_id, expected, local)
    return max(local, expected)
