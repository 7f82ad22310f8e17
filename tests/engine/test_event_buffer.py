"""The telemetry client's buffer (engine/event_buffer.py): a full buffer refuses events without
blocking; a batch is handed out when full or when its first event waited long enough; a drain
waits until the last batch was handled and makes the sender stop waiting for more."""

from __future__ import annotations

import threading
import time

import pytest

from engine.event_buffer import EventBuffer
from tests.helpers import numbered_stats


def never() -> bool:
    return False


def test_a_full_buffer_refuses_and_keeps_what_it_holds() -> None:
    buffer = EventBuffer(3, batch_max_events=10, batch_max_seconds=0.01)
    assert [buffer.put(numbered_stats("e", i)) for i in range(5)] == [True, True, True, False, False]
    assert [e.used_bytes for e in buffer.take(0.01, never)] == [0, 1, 2]


def test_a_batch_comes_when_full_at_once_and_otherwise_after_its_age() -> None:
    buffer = EventBuffer(100, batch_max_events=4, batch_max_seconds=5.0)
    for i in range(6):
        buffer.put(numbered_stats("e", i))
    started = time.monotonic()
    assert [e.used_bytes for e in buffer.take(0.01, never)] == [0, 1, 2, 3]
    assert time.monotonic() - started < 1.0  # full: no wait for its age
    buffer.batch_max_seconds = 0.2
    started = time.monotonic()
    assert [e.used_bytes for e in buffer.take(0.01, never)] == [4, 5]
    assert time.monotonic() - started >= 0.15  # two events: it waited for more
    assert buffer.take(0.01, never) == []


def test_drained_waits_for_the_batch_in_hand_and_hurries_the_sender() -> None:
    buffer = EventBuffer(100, batch_max_events=50, batch_max_seconds=30.0)
    for i in range(3):
        buffer.put(numbered_stats("e", i))
    taken: list[int] = []

    def sender() -> None:
        batch = buffer.take(1.0, never)  # would wait 30 s for 50 events, but a drain hurries it
        time.sleep(0.2)
        taken.extend(e.used_bytes for e in batch)
        buffer.done()

    thread = threading.Thread(target=sender)
    thread.start()
    started = time.monotonic()
    assert buffer.drained(10.0)
    assert taken == [0, 1, 2] and time.monotonic() - started < 5.0
    thread.join()
    assert buffer.drained(0.0)


def test_drained_times_out_while_a_batch_is_never_done() -> None:
    buffer = EventBuffer(10, batch_max_events=1, batch_max_seconds=0.01)
    buffer.put(numbered_stats("e", 0))
    assert len(buffer.take(0.01, never)) == 1
    assert not buffer.drained(0.1)
    buffer.done()
    assert buffer.drained(0.1)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        EventBuffer(0, 1, 1.0)
