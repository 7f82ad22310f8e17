"""kvscope against vLLM's CPU build on the same checkpoint, token ids and threads (one JSON object).

vLLM runs in its own venv (``make peer-vllm``) as a worker process
(``benchmarks/peer_vllm_worker.py``) that this script drives over stdin/stdout, so the two
engines alternate: each figure is measured on one, then the other, ``--repeats`` times, and the
median taken. Both use ``--threads`` torch / OpenMP threads (vLLM's OpenMP threads bound to
cores ``0 … threads−1``), bfloat16, greedy decoding, token ids in (no tokenizer on either side).

Figures, each with its kvscope / vLLM ratio (> 1: kvscope faster):

* ``cold_prefill``: time to first token of a fresh prompt of 2K and 8K tokens (vLLM's prefix
  cache reset before each, kvscope's never hit: every prompt is new), kvscope in float32 beside
  (``fp32_ratio``); kvscope prefills in chunks of vLLM's ``max_num_batched_tokens``;
* ``follow_up``: time to first token of a prompt sharing an 8K-token prefix with the one before
  it (a 256-token new suffix) with prefix caching on in both — vLLM's hybrid mode
  ``mamba_cache_mode="align"`` — and the tokens each reused (vLLM's ``num_cached_tokens``,
  kvscope's L*);
* ``decode``: tokens/s of 64 generated tokens after 256-token prompts at batch 1 and 8 (the time
  of 65 less that of one; kvscope batches through its runtime);
* ``weka``: the first 20 requests of the bundled weka slice (``kvscope/data/weka_slice``, token
  ids as ``kvscope replay`` builds them, at most 8K tokens each) through both in arrival order,
  caches warm: TTFT per request and in all, vLLM's cached prompt tokens beside kvscope's hash-hit
  and recoverable tokens;
* ``greedy_top1_agreement_32``: share of the first 32 greedy tokens that agree, after the last
  256 bytes of Tiny Shakespeare (held out from training; served by neither before).

The checkpoint: ``--model`` (a Qwen3-Next directory both load as it is), by default the trained
``engine/weights/qwen3_next-hd64`` (head dim 64, which vLLM's CPU attention takes; ``qwen3_next-small``'s
32 it refuses), or ``random``: a random-weight tiny Qwen3-Next built with transformers.
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


def busy_cores(seconds: float = 0.1) -> float:
    """Cores busy over the next ``seconds`` (``/proc/stat``; 0 where it cannot be read)."""
    def read() -> tuple[int, int]:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)

    try:
        busy0, all0 = read()
        time.sleep(seconds)
        busy1, all1 = read()
    except (OSError, ValueError, IndexError):
        time.sleep(seconds)
        return 0.0
    return (busy1 - busy0) / max(1, all1 - all0) * (os.cpu_count() or 1)


def settle(limit_seconds: float = 5.0) -> None:
    """Wait until the machine is idle (under a quarter of a core busy): after a request vLLM's
    CPU build keeps a core busy for about a second (measured here), which would slow whichever
    engine runs next."""
    deadline = time.monotonic() + limit_seconds
    while busy_cores() > 0.25 and time.monotonic() < deadline:
        pass
TRAINED = ROOT / "engine/weights/qwen3_next-hd64"
"""The trained Qwen3-Next-layout checkpoint whose head dim (64) vLLM's CPU attention takes."""


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
    def __init__(self, model: Path, threads: int, log: Path, max_model_len: int = 9216) -> None:
        self._log = log.open("w")
        self.process = subprocess.Popen(
            # -I: benchmarks/ (whose kernels.py would shadow the hub's ``kernels`` package transformers probes) stays off the path
            [str(VLLM_PYTHON), "-I", str(ROOT / "benchmarks/peer_vllm_worker.py"), str(model), "--threads", str(threads),
             "--max-model-len", str(max_model_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=ROOT,
        )  # fmt: skip
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self._log.flush()
            tail = Path(self._log.name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the vLLM worker exited ({self.process.wait()}); the end of its log:\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        """One command; returns once the machine is idle again (:func:`settle`)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        settle()
        return answer

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
    parser.add_argument("--model", type=Path, default=TRAINED, help="a Qwen3-Next directory both load (default: %(default)s; 'random': a random tiny one)")
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
        random = str(args.model) == "random"
        model = Path(tmp) / "tiny-qwen3-next" if random else args.model
        if random:
            tiny_checkpoint(model)
        worker = VllmWorker(model, args.threads, Path(tmp) / "vllm.log", max_model_len=max(max(lengths), 8192) + 1024)
        blocks = 4 * max(lengths) // 16 + 64
        chunk = max(16, (worker.hello.get("max_num_batched_tokens") or 2048) // 16 * 16)  # vLLM's scheduler budget
        cache = CacheConfig(full_kv_blocks=blocks, linear_checkpoints=4 * max(lengths) // 128 + 16, max_prefill_chunk_tokens=chunk)
        ours = LLM(str(model), device="cpu", dtype="bfloat16", cache=cache)
        fp32 = LLM(str(model), device="cpu", dtype="float32", cache=cache)
        result: dict[str, Any] = {"vllm": worker.hello, "model": "random tiny qwen3_next (head dim 64)" if random else str(model.relative_to(ROOT) if model.is_relative_to(ROOT) else model), "threads": args.threads}
        try:
            if not worker.hello["ready"]:
                result["error"] = worker.hello["error"]
            else:
                result["kvscope_prefill_chunk_tokens"] = chunk
                result.update(measure(worker, ours, fp32, lengths, args.repeats, SamplingParams))
        finally:
            ours.close()
            fp32.close()
            worker.close()
    result["loadavg"] = os.getloadavg()
    print(json.dumps(result))


def measure(worker: VllmWorker, ours: Any, fp32: Any, lengths: list[int], repeats: int, sampling: Any) -> dict[str, Any]:
    def kv_first(prompt: list[int], llm: Any = ours) -> tuple[float, Any]:
        t0 = time.perf_counter()
        out = llm.generate(prompt, sampling(max_tokens=1))[0]
        seconds = time.perf_counter() - t0
        settle()
        return seconds, out

    cold = []
    for n in lengths:
        worker.ask(op="generate", prompts=[ids(n, 999)], max_tokens=2)  # warm all three at this length
        kv_first(ids(n, 998))
        kv_first(ids(n, 997), fp32)
        a, b, c = [], [], []
        for r in range(repeats):
            worker.ask(op="reset")
            b.append(worker.ask(op="generate", prompts=[ids(n, 10 * n + r)], max_tokens=1)["seconds"])
            a.append(kv_first(ids(n, 20 * n + r))[0])
            c.append(kv_first(ids(n, 30 * n + r), fp32)[0])
        k, v, f = statistics.median(a), statistics.median(b), statistics.median(c)
        cold.append({
            "tokens": n, "kvscope_ttft_s": round(k, 4), "vllm_ttft_s": round(v, 4), "ratio": ratio(k, v),
            "kvscope_fp32_ttft_s": round(f, 4), "fp32_ratio": ratio(f, v),
        })  # fmt: skip
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
    decode = []
    for batch in (1, 8):
        prompts = [ids(256, 7 + i) for i in range(batch)]
        a, b = [], []
        for _ in range(repeats):
            worker.ask(op="reset")
            long = worker.ask(op="generate", prompts=prompts, max_tokens=65)
            b.append(long["seconds"] - worker.ask(op="generate", prompts=prompts, max_tokens=1)["seconds"])
            t0 = time.perf_counter()
            kv_batch(ours, prompts, 65, sampling)
            t1 = time.perf_counter()
            kv_batch(ours, prompts, 1, sampling)
            a.append((t1 - t0) - (time.perf_counter() - t1))
            settle()
        k, v = statistics.median(a), statistics.median(b)
        decode.append({
            "batch": batch, "tokens": 64, "kvscope_tokens_per_s": round(batch * 64 / k, 1), "vllm_tokens_per_s": round(batch * 64 / v, 1),
            "ratio": ratio(k, v),
        })  # fmt: skip
    text = ROOT.parent / "shared/data/text/tinyshakespeare/input.txt"  # held-out bytes: the model is trained on bytes
    fresh = list(text.read_bytes()[-256:]) if text.is_file() else ids(256, 12345)
    theirs = worker.ask(op="generate", prompts=[fresh], max_tokens=32)["outputs"][0]
    mine_fresh = ours.generate(fresh, sampling(max_tokens=32))[0].output_token_ids
    agreement = sum(x == y for x, y in zip(mine_fresh, theirs, strict=True)) / 32
    return {"cold_prefill": cold, "follow_up": follow, "decode": decode, "greedy_top1_agreement_32": agreement, "weka": weka(worker, ours, sampling)}


def kv_batch(ours: Any, prompts: list[list[int]], max_tokens: int, sampling: Any) -> list[list[int]]:
    """kvscope decoding ``prompts`` as one batch (its runtime's continuous batching)."""
    from engine.runtime import Runtime, SchedulerConfig

    runtime = Runtime(ours, SchedulerConfig(max_num_seqs=len(prompts)))
    added = [runtime.add_request(p, sampling(max_tokens=max_tokens)) for p in prompts]
    runtime.run()
    return [list(r.output_token_ids) for r in added]


def weka(worker: VllmWorker, ours: Any, sampling: Any, count: int = 20, max_prompt: int = 8192) -> dict[str, Any]:
    """The bundled weka slice's first ``count`` requests by arrival (token ids as ``kvscope
    replay`` builds them, prompts cut to ``max_prompt``), one after another through both with
    their caches warm from the requests before: TTFT and reused tokens per request."""
    from engine.trace.formats import load_trace
    from engine.trace.prompts import PromptBuilder
    from engine.trace.replay import DEFAULT_SCALE

    requests = load_trace(ROOT / "kvscope/data/weka_slice/traces")[:count]
    builder = PromptBuilder(max(1, requests[0].block_tokens // DEFAULT_SCALE), ours.layout.vocab_size)
    worker.ask(op="reset")
    rows, ours_total, theirs_total = [], 0.0, 0.0
    for request in requests:
        prompt = builder.prompt(request)[:max_prompt]
        answer = worker.ask(op="generate", prompts=[prompt], max_tokens=1)
        t0 = time.perf_counter()
        out = ours.generate(prompt, sampling(max_tokens=1))[0]
        seconds = time.perf_counter() - t0
        settle()
        ours_total += seconds
        theirs_total += answer["seconds"]
        rows.append({
            "request": request.request_id, "prompt_tokens": len(prompt), "vllm_cached_tokens": answer["cached_tokens"][0],
            "kvscope_hash_hit_tokens": out.cache.hash_hit_tokens, "kvscope_recoverable_tokens": out.cache.recoverable_tokens,
            "kvscope_ttft_s": round(seconds, 4), "vllm_ttft_s": round(answer["seconds"], 4),
        })  # fmt: skip
    return {
        "requests": len(rows), "max_prompt_tokens": max_prompt, "kvscope_ttft_s_total": round(ours_total, 3),
        "vllm_ttft_s_total": round(theirs_total, 3), "ratio": ratio(ours_total, theirs_total), "per_request": rows,
    }  # fmt: skip


if __name__ == "__main__":
    main()
