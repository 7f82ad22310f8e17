"""The engine-side cost of telemetry: one ``TelemetryClient.emit`` call, side by side with a bare
``queue.Queue.put_nowait`` of the same event (the floor), with the agent unreachable and a spool
taking every batch (the worst case for the sender thread competing with the engine step).
Prints one JSON object: ``{"events", "emit_ns_per_event", "queue_put_ns_per_event", "ratio",
"spooled_events", "dropped_events"}``.

``python -m benchmarks.telemetry_emit [--events N]``
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import time
from pathlib import Path

from engine.events import EngineStats, Form, Tier
from engine.telemetry import TelemetryClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=200_000)
    args = parser.parse_args()
    event = EngineStats(
        ts=time.time(), engine_id="bench", model="m", form=Form.FULL_KV, tier=Tier.DEVICE,
        used_bytes=0, used_blocks=0, cached_blocks=0, free_blocks=0, total_blocks=1,
    )  # fmt: skip
    floor: queue.Queue[EngineStats] = queue.Queue(maxsize=args.events + 1)
    t0 = time.perf_counter_ns()
    for _ in range(args.events):
        floor.put_nowait(event)
    put_ns = (time.perf_counter_ns() - t0) / args.events
    with tempfile.TemporaryDirectory() as where:
        client = TelemetryClient(
            "http://127.0.0.1:9", "bench", max_queue_events=args.events + 1, spool_path=Path(where) / "bench.spool", spool_max_bytes=1 << 30
        )
        t0 = time.perf_counter_ns()
        for _ in range(args.events):
            client.emit(event)
        emit_ns = (time.perf_counter_ns() - t0) / args.events
        client.flush(timeout_seconds=300)
        client.close(timeout_seconds=0.1)
    doc = {
        "events": args.events,
        "emit_ns_per_event": emit_ns,
        "queue_put_ns_per_event": put_ns,
        "ratio": emit_ns / put_ns,
        "spooled_events": client.spooled_events,
        "dropped_events": client.dropped_events,
    }
    print(json.dumps(doc))
    print(f"emit {emit_ns:.0f} ns/event, queue put {put_ns:.0f} ns/event", file=sys.stderr)


if __name__ == "__main__":
    main()
