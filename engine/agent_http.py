"""The HTTP side of the engine's telemetry client (:mod:`engine.telemetry`): posting one encoded
batch to the agent with retries, and reading the checkpoint epoch out of the agent's answers
(the end-to-end acknowledgement of ``docs/agent.md``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

import httpx

from engine.events_arrow import media_type

log = logging.getLogger(__name__)

PostOutcome = Literal["sent", "rejected", "unreachable"]


def post_batch(
    http: httpx.Client, url: str, body: bytes, seq: int | None, attempts: int, stop: threading.Event
) -> tuple[PostOutcome, dict[str, object] | None, str]:
    """POST one encoded batch to ``url`` (``/v1/events``), its content type read off the body
    (:func:`engine.events_arrow.media_type`: Arrow, or msgpack from an older engine's spool): ``sent`` (stored or a duplicate, with
    the agent's answer when it is a JSON object), ``rejected`` (4xx, never retried; with the
    agent's reason, at most 500 characters) or ``unreachable`` (connection errors / 5xx after
    ``attempts``; the backoff doubles from 0.1 s up to 2 s and stops early once ``stop`` is set)."""
    delay = 0.1
    for attempt in range(1, attempts + 1):
        try:
            resp = http.post(url, content=body, headers={"Content-Type": media_type(body)})
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            if resp.status_code < 300:
                try:
                    answer = resp.json()
                except ValueError:
                    answer = None
                return "sent", answer if isinstance(answer, dict) else None, ""
            if resp.status_code < 500:
                return "rejected", None, resp.text[:500]
            reason = f"HTTP {resp.status_code}"
        if attempt < attempts and not stop.is_set():
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        log.warning("telemetry batch seq=%s attempt %d failed: %s", seq, attempt, reason)
    return "unreachable", None, ""


def epoch_of(answer: dict[str, object]) -> int | None:
    """The agent's checkpoint epoch in an answer (None: an agent without watermarks)."""
    epoch = answer.get("checkpoint_epoch")
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
