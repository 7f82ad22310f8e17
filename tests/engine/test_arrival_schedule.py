"""The replay's one schedule (engine.trace.schedule.ArrivalSchedule): closed-loop sessions, at most
``limit`` requests out, first arrival first, so a follow-up turn is not put behind later first
turns that queued while it waited."""

from __future__ import annotations

import pytest

from engine.trace.formats import TraceRequest
from engine.trace.schedule import ArrivalSchedule


def request(rid: str, session: str, t: float) -> TraceRequest:
    return TraceRequest(
        arrival_seconds=t, session_id=session, request_id=rid, namespace=session, hash_ids=(1,),
        input_tokens=64, output_tokens=64, block_tokens=64,
    )  # fmt: skip


def ids(reqs: list[TraceRequest]) -> list[str]:
    return [r.request_id for r in reqs]


def test_a_follow_up_goes_before_later_first_turns() -> None:
    reqs = [request("a1", "a", 0.0), request("a2", "a", 1.0), request("b1", "b", 2.0), request("c1", "c", 3.0)]
    s = ArrivalSchedule(reqs, speed=1.0, max_wait_seconds=10.0, limit=1)
    assert ids(s.take_due(100.0)) == ["a1"]  # all due; one out at a time
    assert s.take_due(100.0) == [] and s.next_due() is None
    s.ended(reqs[0])
    assert ids(s.take_due(100.0)) == ["a2"]  # a's follow-up arrived before b1 and c1
    s.ended(reqs[1])
    assert ids(s.take_due(100.0)) == ["b1"]
    s.ended(reqs[2])
    assert ids(s.take_due(100.0)) == ["c1"] and not s.finished()
    s.ended(reqs[3])
    assert s.finished() and s.not_sent() == 0


def test_sessions_go_out_together_within_the_limit_and_not_before_their_arrival() -> None:
    reqs = [request("a1", "a", 0.0), request("b1", "b", 0.0), request("c1", "c", 0.0), request("d1", "d", 30.0)]
    s = ArrivalSchedule(reqs, speed=2.0, max_wait_seconds=5.0, limit=2)
    assert s.offsets == {"a1": 0.0, "b1": 0.0, "c1": 0.0, "d1": 5.0}  # 30 s / 2, capped at 5
    assert ids(s.take_due(0.0)) == ["a1", "b1"]
    s.ended(reqs[1])
    assert ids(s.take_due(0.0)) == ["c1"]
    s.ended(reqs[0])
    s.ended(reqs[2])
    assert s.take_due(4.9) == [] and s.next_due() == 5.0
    assert ids(s.take_due(5.0)) == ["d1"]


def test_close_sends_nothing_more_and_a_stray_end_raises() -> None:
    reqs = [request("a1", "a", 0.0), request("a2", "a", 1.0)]
    s = ArrivalSchedule(reqs, speed=1.0, max_wait_seconds=1.0, limit=4)
    (first,) = s.take_due(0.0)
    s.close()
    assert not s.finished()  # a1 is still out
    s.ended(first)
    assert s.finished() and s.take_due(10.0) == [] and s.not_sent() == 1
    with pytest.raises(RuntimeError, match="was not out"):
        s.ended(first)
    with pytest.raises(ValueError, match="at least 1"):
        ArrivalSchedule(reqs, speed=1.0, max_wait_seconds=1.0, limit=0)
