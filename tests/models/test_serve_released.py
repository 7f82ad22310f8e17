"""``kvscope serve --model DIR`` on a Qwen3.5 checkpoint saved by transformers in the released
vision-language layout and on a whole-model DeepSeek-V4 (mHC, MoE, hash-MoE) saved by
transformers, answering the official ``openai`` client (issue 21 acceptance; the
server runs as the command a user types, in its own process on loopback, stopped by PID)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.agent_process import wait_ready
from tests.helpers import free_port

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.models import test_deepseek_v4_model_parity as deepseek_v4  # noqa: E402 (needs transformers)
from tests.models import test_qwen3_5_parity as qwen3_5  # noqa: E402

SAVERS = {
    "qwen3_5": lambda path: qwen3_5.save_hf_checkpoint(path, "vision_language", 7),
    "deepseek_v4": lambda path: deepseek_v4.save_hf_checkpoint(path, "hc2-sqrtsoftplus", 7),
}


@pytest.mark.parametrize("family", list(SAVERS))
def test_kvscope_serve_answers_the_openai_client_for_a_released_layout(tmp_path: Path, family: str) -> None:
    path = tmp_path / family
    SAVERS[family](path)
    port = free_port()
    repo = Path(__file__).resolve().parents[2]
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "serve", "--model", str(path), "--port", str(port), "--device", "cpu"],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(server, port, timeout=60, path="/health")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [str(path)]
        answer = client.completions.create(model=str(path), prompt="The cache", max_tokens=6, temperature=0.0)
        expected = LLM(str(path), device="cpu").generate(["The cache"], SamplingParams(max_tokens=6, temperature=0.0))[0]
        assert answer.choices[0].text == expected.text and answer.usage.completion_tokens == 6
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
