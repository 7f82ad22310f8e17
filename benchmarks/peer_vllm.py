"""kvscope against vLLM's CPU build on the same checkpoint, token ids and threads (one JSON object).

vLLM runs in its own venv (``make peer-vllm``) as a worker process
(``benchmarks/peer_vllm_worker.py``) that this script drives over stdin/stdout, so the two
engines alternate: each figure is measured on one, then the other, ``--repeats`` times, and the
median taken. Both use ``--threads`` torch / OpenMP threads (vLLM's OpenMP threads bound to
cores ``0 … threads−1``), bfloat16, greedy decoding, token ids in (no tokenizer on either side).

Figures, each with its kvscope / vLLM ratio (> 1: kvscope faster):

* ``cold_prefill``: time to first token of a fresh prompt of 2K and 8K tokens (vLLM's prefix
  cache reset before each, kvscope's never hit: every prompt is new);
* ``follow_up``: time to first token of a prompt sharing an 8K-token prefix with the one before
  it (a 256-token new suffix) with prefix caching on in both — vLLM's hybrid mode
  ``mamba_cache_mode="align"`` — and the tokens each reused (vLLM's ``num_cached_tokens``,
  kvscope's L*);
* ``decode``: tokens/s of 64 generated tokens after a 256-token prompt, batch 1 (the time of 65
  less that of one);
* ``greedy_top1_agreement_32``: share of the first 32 greedy tokens that agree.

The checkpoint: ``--model`` (a Qwen3-Next directory both load as it is), else a random-weight
tiny Qwen3-Next in shapes vLLM's CPU path accepts (head dim 64), built with transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def tiny_checkpoint(directory: Path) -> None:
    """A random-weight Qwen3-Next (4 layers, head dim 64, bf16) with ``architectures`` set."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        max_position_embeddings=16384, architectures=["Qwen3NextForCausalLM"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


class VllmWorker:
    def __init__(self, model: Path, threads: int, log: Path) -> None:
        self._log = log.open("w")
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(ROOT / "benchmarks/peer_vllm_worker.py"), str(model), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=ROOT,
        )  # fmt: skip
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited ({self.process.wait()}); see {self._log.name}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError):
                self.ask(op="quit")
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 131 + (i * i) % 97) % 255 + 1 for i in range(n)]


def ratio(ours: float, theirs: float) -> float:
    return round(theirs / ours, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit("vLLM's CPU build is not installed: run `make peer-vllm`")
    import torch

    from engine.cache.config import CacheConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or Path(tmp) / "tiny-qwen3-next"
        if args.model is None:
            tiny_checkpoint(model)
        worker = VllmWorker(model, args.threads, Path(tmp) / "vllm.log")
        blocks = 4 * max(lengths) // 16 + 64
        ours = LLM(str(model), device="cpu", dtype="bfloat16", cache=CacheConfig(full_kv_blocks=blocks, linear_checkpoints=4 * max(lengths) // 128 + 16))
        result: dict[str, Any] = {"vllm": worker.hello, "model": str(args.model or "random tiny qwen3_next (head dim 64)"), "threads": args.threads}
        try:
            if not worker.hello["ready"]:
                result["error"] = worker.hello["error"]
            else:
                result.update(measure(worker, ours, lengths, args.repeats, SamplingParams))
        finally:
            ours.close()
            worker.close()
    result["loadavg"] = os.getloadavg()
    print(json.dumps(result))


def measure(worker: VllmWorker, ours: Any, lengths: list[int], repeats: int, sampling: Any) -> dict[str, Any]:
    def kv_first(prompt: list[int]) -> tuple[float, Any]:
        t0 = time.perf_counter()
        out = ours.generate(prompt, sampling(max_tokens=1))[0]
        return time.perf_counter() - t0, out

    worker.ask(op="generate", prompts=[ids(256, 999)], max_tokens=2)  # warm both
    kv_first(ids(256, 998))
    cold = []
    for n in lengths:
        a, b = [], []
        for r in range(repeats):
            worker.ask(op="reset")
            b.append(worker.ask(op="generate", prompts=[ids(n, 10 * n + r)], max_tokens=1)["seconds"])
            a.append(kv_first(ids(n, 20 * n + r))[0])
        k, v = statistics.median(a), statistics.median(b)
        cold.append({"tokens": n, "kvscope_ttft_s": round(k, 4), "vllm_ttft_s": round(v, 4), "ratio": ratio(k, v)})
    prefix = ids(max(lengths), 5)
    a, b, reused_v, reused_k = [], [], [], []
    worker.ask(op="reset")
    for r in range(repeats + 1):
        prompt = prefix + ids(256, 100 + r)
        answer = worker.ask(op="generate", prompts=[prompt], max_tokens=1)
        seconds, out = kv_first(prompt)
        if r:  # the first one stored the prefix
            b.append(answer["seconds"])
            reused_v.append(answer["cached_tokens"][0])
            a.append(seconds)
            reused_k.append(out.cache.resume_tokens)
    k, v = statistics.median(a), statistics.median(b)
    follow = {
        "prefix_tokens": len(prefix), "suffix_tokens": 256, "kvscope_ttft_s": round(k, 4), "vllm_ttft_s": round(v, 4), "ratio": ratio(k, v),
        "vllm_cached_tokens": reused_v, "kvscope_resume_tokens": reused_k, "vllm_prefix_caching_mode": "mamba_cache_mode=align",
    }  # fmt: skip
    prompt = ids(256, 7)
    a, b = [], []
    for _ in range(repeats):
        worker.ask(op="reset")
        long, short = worker.ask(op="generate", prompts=[prompt], max_tokens=65), worker.ask(op="generate", prompts=[prompt], max_tokens=1)
        b.append(long["seconds"] - short["seconds"])
        t0 = time.perf_counter()
        mine = ours.generate(prompt, sampling(max_tokens=65))[0]
        t1 = time.perf_counter()
        ours.generate(prompt, sampling(max_tokens=1))
        a.append((t1 - t0) - (time.perf_counter() - t1))
    k, v = statistics.median(a), statistics.median(b)
    agreement = sum(x == y for x, y in zip(mine.output_token_ids[:32], long["outputs"][0][:32], strict=True)) / 32
    decode = {"batch": 1, "tokens": 64, "kvscope_tokens_per_s": round(64 / k, 1), "vllm_tokens_per_s": round(64 / v, 1), "ratio": ratio(k, v)}
    return {"cold_prefill": cold, "follow_up": follow, "decode": [decode], "greedy_top1_agreement_32": agreement}


if __name__ == "__main__":
    main()
