"""The engine-side cost of telemetry, two ways, each side by side in one run:

* **per event**: ``TelemetryClient.emit`` against a bare ``queue.Queue.put_nowait`` of the same
  event (the floor; goal at most 1.5×), with the agent unreachable and a spool taking every
  batch (the sender thread encoding Arrow and writing the spool while the engine emits);
* **per engine step**: the same requests through one ``LLM`` (``kvscope_hybrid-tiny``, block
  events on: the most events per step) with its events going to a ``NullSink`` (off) or to a
  ``TelemetryClient`` whose sender encodes every batch as Arrow and posts it to an in-process
  stand-in for the agent (on), rounds alternating; the ratio of medians, goal at most 1.01.

Prints one JSON object with both, the CPU flags and the load average.

``python -m benchmarks.telemetry_emit [--events N] [--rounds R] [--prompts P]``
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.events import EngineStats, Form, Tier
from engine.sinks import NullSink
from engine.telemetry import TelemetryClient


def per_event(events: int) -> dict[str, float | int]:
    event = EngineStats(
        ts=time.time(), engine_id="bench", model="m", form=Form.FULL_KV, tier=Tier.DEVICE,
        used_bytes=0, used_blocks=0, cached_blocks=0, free_blocks=0, total_blocks=1,
    )  # fmt: skip
    floor: queue.Queue[EngineStats] = queue.Queue(maxsize=events + 1)
    t0 = time.perf_counter_ns()
    for _ in range(events):
        floor.put_nowait(event)
    put_ns = (time.perf_counter_ns() - t0) / events
    with tempfile.TemporaryDirectory() as where:
        client = TelemetryClient(
            "http://127.0.0.1:9", "bench", max_queue_events=events + 1, spool_path=Path(where) / "bench.spool", spool_max_bytes=1 << 30
        )
        t0 = time.perf_counter_ns()
        for _ in range(events):
            client.emit(event)
        emit_ns = (time.perf_counter_ns() - t0) / events
        client.flush(timeout_seconds=300)
        client.close(timeout_seconds=0.1)
    return {
        "events": events,
        "emit_ns_per_event": emit_ns,
        "queue_put_ns_per_event": put_ns,
        "ratio": emit_ns / put_ns,
        "spooled_events": client.spooled_events,
        "dropped_events": client.dropped_events,
    }


def agent_stand_in(request: httpx.Request) -> httpx.Response:
    """Takes every batch, as an agent without durable watermarks answers."""
    if request.url.path.endswith("/next-seq"):
        return httpx.Response(200, json={"next_seq": 0})
    return httpx.Response(200, json={"status": "stored"})


def per_step(rounds: int, prompts: int) -> dict[str, object]:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM("kvscope_hybrid-tiny", device="cpu", block_events=True)
    client = TelemetryClient("http://agent.invalid", llm.engine_id, transport=httpx.MockTransport(agent_stand_in))  # its default batching
    null = NullSink()
    params = SamplingParams(max_tokens=16)
    times: dict[str, list[float]] = {"off": [], "on": []}
    steps = 0
    for r in range(rounds * 2 + 1):
        side = "off" if r % 2 else "on"
        llm.events.sink = client if side == "on" else null
        batch = [[(7 * r + 13 * p + i) % 200 + 1 for i in range(48 + p)] for p in range(prompts)]  # fresh prompts: no hits
        started = time.perf_counter()
        outputs = llm.generate(batch, params)
        elapsed = time.perf_counter() - started
        if r == 0:
            continue  # warm-up
        times[side].append(elapsed)
        steps = sum(len(o.output_token_ids) for o in outputs)
    assert client.flush(timeout_seconds=60)
    client.close(timeout_seconds=5)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {
        "model": "kvscope_hybrid-tiny",
        "rounds_per_side": rounds,
        "requests_per_round": prompts,
        "decode_steps_per_round": steps,
        "events_sent": client.sent_events,
        "off_seconds_median": off,
        "on_seconds_median": on,
        "off_seconds": times["off"],
        "on_seconds": times["on"],
        "ratio": on / off,
    }


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=200_000, help="events for the per-event figure (default 200000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side for the per-step figure (default 5)")
    parser.add_argument("--prompts", type=int, default=8, help="requests per round (default 8)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    doc = {
        "per_event": per_event(args.events),
        "per_step": per_step(args.rounds, args.prompts),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(doc))
    print(
        f"emit {doc['per_event']['emit_ns_per_event']:.0f} ns/event vs queue put {doc['per_event']['queue_put_ns_per_event']:.0f} "  # type: ignore[index]
        f"(ratio {doc['per_event']['ratio']:.2f}); engine step with telemetry on/off {doc['per_step']['ratio']:.3f}",  # type: ignore[index]
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
