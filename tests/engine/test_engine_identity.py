"""Engine identity (issue 24): the engine id the CLI derives from host and model (stable across
restarts), the check of one given with ``--engine-id``, the run id, and where a run's batch seqs
start (``engine/run_seq.py``): continuing the spool's and the agent's count, never reusing one."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.events import EngineStats, Form, Tier
from engine.events_arrow_check import batch_dict
from engine.identity import ENGINE_ID_MAX_CHARS, check_engine_id, derived_engine_id, new_run_id
from engine.run_seq import first_seq
from engine.telemetry import TelemetryClient
from kvscope.cli_args import UserError, engine_id_arg
from kvscope.cli_parser import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("model", "host", "expected"),
    [
        ("kvscope_hybrid-small", "node1", "node1-kvscope_hybrid-small"),
        ("/models/Qwen3-Next-80B-A3B/", "GPU-Node.lab", "gpu-node.lab-qwen3-next-80b-a3b"),
        ("Qwen/Qwen3-8B", "h", "h-qwen3-8b"),
        ("my model (v2)", "host name", "host-name-my-model-v2"),
        ("..", ".", "engine"),
    ],
)
def test_the_derived_engine_id_is_host_and_model_in_allowed_characters(model: str, host: str, expected: str) -> None:
    derived = derived_engine_id(model, host=host)
    assert derived == expected
    assert check_engine_id(derived) == derived
    assert derived_engine_id(model, host=host) == derived  # the same at every restart


def test_a_long_derived_id_is_cut_to_the_limit() -> None:
    derived = derived_engine_id("m" * 500, host="h")
    assert len(derived) == ENGINE_ID_MAX_CHARS and check_engine_id(derived) == derived


@pytest.mark.parametrize("bad", ["", "a/b", "../spool", ".hidden", "-x", "e 1", "é", "x" * (ENGINE_ID_MAX_CHARS + 1)])
def test_a_bad_engine_id_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="is not allowed"):
        check_engine_id(bad)
    with pytest.raises(UserError, match="--engine-id") as error:
        engine_id_arg(argparse.Namespace(engine_id=bad, model="m"))
    assert repr(bad) in str(error.value)


def test_up_replay_and_serve_take_engine_id_and_default_to_the_derived_one(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for argv in (["up"], ["replay", "t.jsonl"], ["serve"]):
        args = parser.parse_args([*argv, "--model", "kvscope_hybrid-small"])
        assert args.engine_id is None and engine_id_arg(args) == derived_engine_id("kvscope_hybrid-small")
        given = parser.parse_args([*argv, "--engine-id", "prod-a.1"])
        assert engine_id_arg(given) == "prod-a.1"
        with pytest.raises(SystemExit):
            parser.parse_args([argv[0], "--help"])
        page = " ".join(capsys.readouterr().out.split())
        assert "--engine-id" in page and "(default: derived from host and model: HOST-MODEL)" in page


def test_run_ids_are_new_and_sort_by_start_time() -> None:
    first = new_run_id()
    time.sleep(0.002)
    second = new_run_id()
    assert len(first) == 32 and int(first, 16) >= 0 and first != second and first < second


def test_the_identity_needs_no_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; from engine.identity import derived_engine_id; print(derived_engine_id('m', host='h'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "h-m", out.stderr


def agent(next_seq: int | None, *, status: int = 200, down: bool = False, posts: list[dict] | None = None) -> httpx.MockTransport:
    """A transport to a stand-in agent answering ``/v1/ingest/next-seq`` with ``next_seq``
    (None: an answer without it), storing posted batches in ``posts``."""

    def handle(request: httpx.Request) -> httpx.Response:
        if down:
            raise httpx.ConnectError("agent down", request=request)
        if request.url.path == "/v1/ingest/next-seq":
            assert request.url.params["engine_id"] == "e-id"
            return httpx.Response(status, json={} if next_seq is None else {"engine_id": "e-id", "next_seq": next_seq})
        if posts is not None and request.url.path == "/v1/events":
            posts.append(batch_dict(request.content))
            return httpx.Response(200, json={"status": "stored"})
        return httpx.Response(404, json={})

    return httpx.MockTransport(handle)


EVENTS = "http://agent.invalid/v1/events"


@pytest.mark.parametrize(
    ("agent_says", "spooled", "expected"),
    [
        (7, None, 7),  # no spool: where the agent's count is
        (7, 3, 7),  # a spool lost or older than the agent's count
        (7, 9, 9),  # the spool holds batches the agent has not received yet
        (0, 4, 4),  # an agent that never heard of the engine (a new database)
        (None, 4, 4),  # an agent that does not say
    ],
)
def test_a_run_starts_at_the_larger_of_the_spools_and_the_agents_count(agent_says: int | None, spooled: int | None, expected: int) -> None:
    http = httpx.Client(transport=agent(agent_says))
    assert first_seq(http, EVENTS, "e-id", spool_next_seq=spooled, attempts=1, stop=threading.Event()) == expected


def test_an_older_agent_without_the_route_leaves_the_local_count() -> None:
    older = httpx.Client(transport=agent(None, status=404))
    assert first_seq(older, EVENTS, "e-id", spool_next_seq=5, attempts=1, stop=threading.Event()) == 5
    assert first_seq(older, EVENTS, "e-id", spool_next_seq=None, attempts=1, stop=threading.Event()) == 0


def test_an_unreachable_agent_is_not_waited_for_with_a_spool_and_is_without() -> None:
    down = httpx.Client(transport=agent(3, down=True))
    assert first_seq(down, EVENTS, "e-id", spool_next_seq=2, attempts=8, stop=threading.Event()) == 2
    assert first_seq(down, EVENTS, "e-id", spool_next_seq=None, attempts=2, stop=threading.Event()) is None


def _stats(i: int) -> EngineStats:
    return EngineStats(ts=1.0 + i, engine_id="e-id", model="m", form=Form.FULL_KV, tier=Tier.DEVICE, used_bytes=i,
                       used_blocks=0, cached_blocks=0, free_blocks=0, total_blocks=1)  # fmt: skip


def test_the_client_continues_at_the_agents_seq_and_stamps_its_run_id() -> None:
    posts: list[dict] = []
    transport = agent(12, posts=posts)
    client = TelemetryClient("http://agent.invalid", "e-id", batch_max_events=2, batch_max_seconds=1.0, run_id="run-a", transport=transport)
    for i in range(4):
        client.emit(_stats(i))
    assert client.flush(timeout_seconds=10)
    client.close(timeout_seconds=5)
    assert [(b["seq"], b["run_id"], len(b["events"])) for b in posts] == [(12, "run-a", 2), (13, "run-a", 2)]
    assert client.lost_events == 0


def test_without_a_spool_no_batch_is_stamped_until_the_agent_answers() -> None:
    """A batch sent while the agent cannot say where the engine's seqs are is dropped (counted),
    as it would be after the post's retries; the next batch asks again."""
    client = TelemetryClient("http://agent.invalid", "e-id", batch_max_events=1, max_retries=1, transport=agent(3, down=True))
    client.emit(_stats(0))
    assert client.flush(timeout_seconds=10)
    assert client.dropped_events == 1 and client.failed_batches == 1 and client.sent_batches == 0
    client.close(timeout_seconds=2)
