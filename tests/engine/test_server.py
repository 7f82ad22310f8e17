"""``kvscope serve``'s OpenAI-compatible API, driven by the official ``openai`` client against a
real uvicorn server on loopback: completions and chat completions, streaming and not, stop
strings, usage with cached tokens, OpenAI-style errors, concurrent requests equal to one at a
time, and a client that disconnects mid-stream (its request aborted, its blocks freed)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.cache import CacheConfig
from engine.events import RequestEvent
from engine.llm import LLM
from engine.runtime import Runtime, SchedulerConfig
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.openai_api import StopStrings, render_chat
from engine.runtime.request import RuntimeRequest
from engine.runtime.server import create_app, serve_in_thread
from engine.sampling import SamplingParams
from engine.telemetry import ListSink
from engine.trace.formats import TraceRequest, load_trace
from engine.trace.http_replay import replay_over_http
from engine.trace.replay import ReplayConfig
from tests.helpers import TOLERANCE, assert_no_leases, free_port

MODEL = "kvscope_hybrid-tiny"
WEKA_SLICE = Path(__file__).resolve().parents[2] / "kvscope" / "data" / "weka_slice" / "traces"
PROMPT = "The prefix cache keeps every form of state explicit. "


@dataclass
class Served:
    url: str
    llm: LLM
    runtime: Runtime
    sink: ListSink

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def wait_idle(self) -> None:
        deadline = time.monotonic() + 30
        while self.runtime.has_unfinished():
            assert time.monotonic() < deadline, "the runtime never went idle"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    sink = ListSink()
    llm = LLM(MODEL, device="cpu", telemetry=sink, check_invariants=True)
    with serve(llm, Runtime(llm, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)), sink) as s:
        yield s


@contextlib.contextmanager
def serve(llm: LLM, runtime: Runtime, sink: ListSink) -> Iterator[Served]:
    """uvicorn on a free loopback port in a thread, until the block ends."""
    with serve_in_thread(create_app(EngineLoop(runtime), MODEL), free_port()) as url:
        yield Served(url, llm, runtime, sink)


def reference_text(prompt: str, max_tokens: int) -> str:
    llm = LLM(MODEL, device="cpu")
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return out.text


def test_completions_streamed_and_not_agree_with_the_engine(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    want = reference_text(PROMPT, 12)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(PROMPT.encode()) and whole.usage.completion_tokens == 12
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens and again.usage.prompt_tokens_details.cached_tokens >= 32  # the prefix cache
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_completions_streamed_and_not(served: Served) -> None:
    client = served.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block table?"}]
    want = reference_text(render_chat_text(messages), 8)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == want
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def render_chat_text(messages: list[dict[str, str]]) -> str:
    from engine.runtime.openai_api import ChatMessage

    return render_chat([ChatMessage.model_validate(m) for m in messages])


def test_stop_strings_end_the_text_before_them(served: Served) -> None:
    client = served.client()
    full = reference_text(PROMPT, 16)
    stop = full[5:7]
    cut = full[: full.index(stop)]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "never-seen"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"
    served.wait_idle()
    assert_no_leases(served.llm)
    ended = [e.output_tokens for e in served.sink.events if isinstance(e, RequestEvent)][-2:]
    assert all(n < 16 for n in ended), ended  # both stopped requests were aborted in the engine, not run to max_tokens


def test_stop_strings_hold_back_a_possible_start() -> None:
    cutter = StopStrings(["END"])
    assert cutter.push("abcE") == ("ab", False)  # "cE" might still begin "END"
    assert cutter.push("N") == ("c", False)
    assert cutter.push("D tail") == ("", True)  # the stop and what follows never show
    other = StopStrings(["xy"])
    assert other.push("ax") == ("a", False) and other.push("z") == ("x", False) and other.flush() == "z"


def test_bad_requests_get_openai_errors(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=5)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="full_kv"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000_000)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 2, 99_999], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4)
    raw = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(f"{served.url}/v1/embeddings", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{served.url}/health", timeout=10).json() == {"status": "ok"}


def test_concurrent_requests_match_one_at_a_time(served: Served) -> None:
    prompts = [f"Session {i}: " + PROMPT * (1 + i % 3) for i in range(8)]
    want = [reference_text(p, 6) for p in prompts]

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        outs = await asyncio.gather(
            *(client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, user=f"s{i % 3}") for i, p in enumerate(prompts))
        )
        await client.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(run_all()) == want
    assert_no_leases(served.llm)


def test_a_client_gone_mid_stream_frees_its_request(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT * 2, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{served.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for _, line in zip(range(4), lines, strict=False) if line.startswith("data: ")]
        assert got
    served.wait_idle()
    assert_no_leases(served.llm)
    ended = [e for e in served.sink.events if isinstance(e, RequestEvent)]
    assert ended and ended[-1].output_tokens < 200  # aborted, not run to max_tokens
    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    assert "kvscope_server_requests_total" in metrics and "kvscope_server_time_to_first_token_seconds_bucket" in metrics
    served.runtime.num_preemptions += 3  # read at scrape time
    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    served.runtime.num_preemptions -= 3
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    preemptions = families["kvscope_server_preemptions"]
    assert preemptions.type == "counter" and preemptions.samples[0].value == served.runtime.num_preemptions + 3


def test_thirty_two_weka_sessions_replayed_through_the_server(tmp_path: Path) -> None:
    """The bundled weka slice's 32 sessions (two requests each) at once over HTTP: every request
    completes, the cache's invariants hold after every engine step, later turns hit the prefix
    cache, and the logits of a sample of requests equal cold recomputes."""
    requests = load_trace(WEKA_SLICE)
    firsts: dict[str, list[TraceRequest]] = {}
    for r in sorted(requests, key=lambda r: r.arrival_seconds):
        firsts.setdefault(r.session_id, [])
        if len(firsts[r.session_id]) < 2:
            firsts[r.session_id].append(r)
    chosen = [r for rs in firsts.values() for r in rs]
    assert len(firsts) == 32 and len(chosen) == 64
    sink = ListSink()
    # room for 32 sessions' windows at once (the runtime admits only what its pools can hold)
    cache = CacheConfig(swa_blocks=2048, linear_checkpoints=512, tail_slots=512)
    llm = LLM(MODEL, device="cpu", telemetry=sink, check_invariants=True, cache=cache)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32))
    sampled: list[RuntimeRequest] = []
    add = runtime.add_request

    def add_sampling_every_eighth(*args: Any, **kwargs: Any) -> RuntimeRequest:
        r = add(*args, **kwargs, keep_logits=len(runtime.requests) % 8 == 0)
        if r.keep_logits:
            sampled.append(r)
        return r

    runtime.add_request = add_sampling_every_eighth  # type: ignore[method-assign]
    most_running = 0

    def step() -> list[RuntimeRequest]:
        nonlocal most_running
        most_running = max(most_running, len(runtime.running))
        return Runtime.step(runtime)

    runtime.step = step  # type: ignore[method-assign]
    config = ReplayConfig(block_tokens=1, speed=1e6, max_wait_seconds=0.0, max_output_tokens=4, max_num_seqs=32)  # every session out at once
    with serve(llm, runtime, sink) as s:
        result = asyncio.run(replay_over_http(s.url, chosen, config))
    assert result.requests == 64 and result.skipped == 0 and result.sessions == 32
    assert most_running >= 16  # the sessions really overlapped in the engine
    assert result.cached_tokens > 0.3 * result.prompt_tokens  # second turns resume from the first
    assert len(result.ttft_seconds) == 64
    assert sampled
    cold = LLM(MODEL, device="cpu")
    for r in sampled:
        for i, row in enumerate(r.sampled_logits):
            want = cold.prefill_logits(r.prompt_token_ids + r.output_token_ids[:i])[-1]
            assert (row - want).abs().max().item() <= TOLERANCE[torch.float32]
    assert_no_leases(llm)


def test_kvscope_replay_drives_a_server(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    from kvscope.cli import main

    argv = ["replay", str(WEKA_SLICE), "--server", served.url, "--max-requests", "12", "--block-tokens", "1", "--speed", "1000000", "--max-output-tokens", "2"]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 12 and summary["output_tokens"] == 24 and summary["ttft_p50_seconds"] > 0
    with pytest.raises(SystemExit) as refused:
        main(["replay", str(WEKA_SLICE), "--server", f"http://127.0.0.1:{free_port()}", "--max-requests", "1"])
    assert refused.value.code == 2 and "no /v1/models answer" in capsys.readouterr().err


def test_swe_agent_trajectories_replay_as_text_chats(shared_data: Path) -> None:
    """SWE-agent trajectories as sessions of chat calls with their real text (about 10k bytes of
    prompt each), concurrently: each call's prompt is the history before one assistant message,
    so a session's later calls resume from the prefix its earlier ones stored. The cache is sized
    for prompts that long (the defaults keep 128 recurrent checkpoints: a few such sessions at
    once evict each other's)."""
    from engine.trace.formats import read_swe_agent
    from engine.trace.http_replay import replay_chats_over_http

    sessions = read_swe_agent(shared_data / "swe_agent_trajectories")
    assert len(sessions) == 17 and all(s.turns for s in sessions)
    first = sessions[0].turns
    assert all(len(b.messages) > len(a.messages) and b.messages[: len(a.messages)] == a.messages for a, b in itertools.pairwise(first))
    small = [dataclasses.replace(s, turns=s.turns[:2]) for s in sessions[:3]]
    sink = ListSink()
    cache = CacheConfig(linear_checkpoints=1024, swa_blocks=4096, compressed_blocks=8192, tail_slots=1024)
    llm = LLM(MODEL, device="cpu", telemetry=sink, cache=cache)
    with serve(llm, Runtime(llm, SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8)), sink) as s:
        result = asyncio.run(replay_chats_over_http(s.url, small, max_output_tokens=2))
        s.wait_idle()
    assert result.requests == 6 and result.skipped == 0 and result.sessions == 3
    assert result.cached_tokens > 0.4 * result.prompt_tokens  # second calls resume from the first
    assert_no_leases(llm)


def test_trajectory_files_are_checked(tmp_path: Path) -> None:
    from engine.trace.formats import TraceError, read_swe_agent

    bad = tmp_path / "broken.traj"
    bad.write_text('{"history": [{"role": "wizard", "content": "hi"}]}')
    with pytest.raises(TraceError, match=r"history\[0\] must have a role"):
        read_swe_agent(bad)
    bad.write_text("not json")
    with pytest.raises(TraceError, match="not a readable trajectory"):
        read_swe_agent(bad)
    with pytest.raises(TraceError, match="no such trace file"):
        read_swe_agent(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no SWE-agent trajectories"):
        read_swe_agent(tmp_path / "empty")


def test_a_client_gone_before_the_answer_frees_its_request(served: Served) -> None:
    """Without a stream (or before the first streamed token) a client that gives up is noticed
    too: its request is aborted, not run to max_tokens."""
    body = {"model": MODEL, "prompt": PROMPT * 3, "max_tokens": 300, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=1.0)
    served.wait_idle()
    assert_no_leases(served.llm)
    ended = [e for e in served.sink.events if isinstance(e, RequestEvent)]
    assert ended[-1].output_tokens < 300


def test_a_dead_engine_answers_500_and_503_instead_of_hanging() -> None:
    sink = ListSink()
    llm = LLM(MODEL, device="cpu", telemetry=sink)
    runtime = Runtime(llm)
    calls = 0

    def failing_step() -> list[RuntimeRequest]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("boom")
        return Runtime.step(runtime)

    runtime.step = failing_step  # type: ignore[method-assign]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    with serve(llm, runtime, sink) as s:
        first = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 500 and "boom" in first.json()["error"]["message"]
        after = httpx.post(f"{s.url}/v1/completions", json=body, timeout=10)
        assert after.status_code == 500 and "not running" in after.json()["error"]["message"]
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 503
