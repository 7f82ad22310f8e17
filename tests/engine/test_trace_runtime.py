"""The in-process replay runs the batched runtime with the HTTP replay's schedule: sessions as
concurrent clients, each session's requests in order, waits only while nothing runs."""

from __future__ import annotations

from engine import LLM, CacheConfig
from engine.trace.formats import TraceRequest
from engine.trace.replay import ReplayConfig, replay
from engine.trace.schedule import compressed_offsets
from tests.helpers import assert_no_leases


def request(rid: str, session: str, t: float, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(
        arrival_seconds=t, session_id=session, request_id=rid, namespace=session, hash_ids=ids,
        input_tokens=64 * len(ids), output_tokens=64, block_tokens=64,
    )  # fmt: skip


class FakeTime:
    """A clock that moves only when the replay sleeps (the engine's work takes no fake time)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def test_sessions_run_concurrently_and_in_order_with_capped_waits() -> None:
    reqs = [
        request("a1", "a", 0.0, (1, 2, 3, 4)),
        request("b1", "b", 0.0, (7, 8, 9, 10)),
        request("a2", "a", 0.5, (1, 2, 3, 4, 5, 6)),  # arrives while a1 may still run: waits for it
        request("b2", "b", 20.0, (7, 8, 9, 10, 11)),  # 19.5 s gap, capped at 5 s
    ]
    assert compressed_offsets(reqs, 1.0, 5.0) == {"a1": 0.0, "b1": 0.0, "a2": 0.5, "b2": 5.5}
    fake = FakeTime()
    ended: list[tuple[str, int]] = []
    llm = LLM(cache=CacheConfig(), check_invariants=True)
    tally = replay(
        llm, reqs, ReplayConfig(speed=1.0, max_wait_seconds=5.0, max_output_tokens=2),
        on_request=lambda done, total, r, out: ended.append((r.request_id, out.cache.recoverable_tokens if out else -1)),
        sleep=fake.sleep, clock=fake.clock,
    )  # fmt: skip
    order = [rid for rid, _ in ended]
    assert sorted(order) == ["a1", "a2", "b1", "b2"] and tally.requests == 4
    assert order.index("a1") < order.index("a2") and order.index("b1") < order.index("b2")
    reused = dict(ended)
    assert reused["a1"] == 0 and reused["b1"] == 0
    assert reused["a2"] >= 16 and reused["b2"] >= 16  # 4 blocks x 4 tokens: each follow-up ran after its first turn was cached
    # the clock moved only by sleeping, so the waits add up to the last offset exactly: 0.5 s to
    # a2's arrival, then to b2's at 5.5 s (a2 and b1 were done by then, in no fake time)
    assert abs(sum(fake.waits) - 5.5) < 1e-9 and all(w >= 0 for w in fake.waits)


def test_stop_lets_running_requests_finish_and_starts_no_more() -> None:
    import threading

    reqs = [request(f"r{i}", f"s{i}", 0.0, (10 * i + 1, 10 * i + 2)) for i in range(6)]
    stop = threading.Event()
    ended: list[str] = []

    def on_request(done: int, total: int, r: TraceRequest, out: object) -> None:
        ended.append(r.request_id)
        stop.set()  # after the first request ends, nothing new starts

    llm = LLM(cache=CacheConfig())
    tally = replay(llm, reqs, ReplayConfig(speed=1e9, max_output_tokens=2), on_request=on_request, stop=stop)
    assert tally.requests == len(ended) == 6  # all six arrived at once and were admitted before the stop
    reqs2 = [request("late", "z", 100.0, (99, 98))]
    stop2 = threading.Event()
    stop2.set()
    assert replay(llm, reqs + reqs2, ReplayConfig(speed=1e9, max_output_tokens=2), stop=stop2).requests == 0


def test_a_stop_drops_the_requests_not_yet_out() -> None:
    import threading

    reqs = [request(f"r{i}", f"s{i}", 0.0, (10 * i + 1, 10 * i + 2)) for i in range(6)]
    stop = threading.Event()
    llm = LLM(cache=CacheConfig())
    config = ReplayConfig(speed=1e9, max_output_tokens=2, max_num_seqs=2)  # two out at once, four waiting their turn
    tally = replay(llm, reqs, config, on_request=lambda *_: stop.set(), stop=stop)
    assert tally.requests == 2 and tally.skipped_requests == 0  # the two out finished; the rest never went out
    assert_no_leases(llm)


def test_a_skipped_request_does_not_end_its_session() -> None:
    huge = request("a1", "a", 0.0, tuple(range(1000, 9300)))  # 8,300 blocks of 4 tokens: past max_model_len 32,768
    reqs = [huge, request("a2", "a", 0.1, (1, 2, 3))]
    ended: list[tuple[str, bool]] = []
    tally = replay(
        LLM(cache=CacheConfig()), reqs, ReplayConfig(speed=1e9, max_output_tokens=2),
        on_request=lambda done, total, r, out: ended.append((r.request_id, out is not None)),
    )  # fmt: skip
    assert ended == [("a1", False), ("a2", True)]
    assert tally.skipped_requests == 1 and tally.requests == 1
