"""``kvscope serve``'s OpenAI-compatible API, driven by the official ``openai`` client against a
real uvicorn server on loopback: completions and chat completions, streaming and not, stop
strings, usage with cached tokens, OpenAI-style errors, concurrent requests equal to one at a
time, and a client that disconnects mid-stream (its request aborted, its blocks freed)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from engine.events import RequestEvent
from engine.llm import LLM
from engine.runtime import Runtime, SchedulerConfig
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.server import StopStrings, create_app, render_chat
from engine.sampling import SamplingParams
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, free_port

MODEL = "kvscope_hybrid-tiny"
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
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(EngineLoop(runtime), MODEL), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        pytest.fail("the server did not come up")
    yield Served(url, llm, runtime, sink)
    server.should_exit = True
    thread.join(30)


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
    from engine.runtime.server import ChatMessage

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
    assert_no_leases(served.llm)  # the stopped request was aborted in the engine


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
