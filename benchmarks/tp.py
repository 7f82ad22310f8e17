"""Tensor parallelism on CPU: the TP=2 over TP=1 step time of one model, side by side in one run,
and the collectives each step runs (one JSON object on stdout; progress on stderr).

``python -m benchmarks.tp [--model M] [--prompt-tokens T] [--decode-steps D] [--repeats R]``

Both engines load the same weights. Every rank runs ``cpu_count // 2`` torch threads, rank 0
included: 1 each on a 2-core machine, where TP=2 uses both cores and TP=1 one. Measured, alternating TP=1 and TP=2 ``R``
times, best of each: a cold prefill of ``T`` tokens (``prefill_logits``, one chunk per
``max_prefill_chunk_tokens``) and ``D`` decode steps after a ``T``-token prompt (the engine's
own decode path). Reported: seconds, the TP=2 / TP=1 ratios (below 1: TP=2 is faster), the
collectives of one prefill and one decode step on rank 0 (counted by the group), and the logits'
largest difference. The load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter

import torch

from engine import LLM, CacheConfig


def _decode(llm: LLM, prompt: list[int], steps: int) -> float:
    """Seconds of ``steps`` decode steps after ``prompt`` (its prefill not counted)."""
    lifecycle = llm.lifecycle
    lease = lifecycle.start(list(prompt), steps)
    try:
        lifecycle.prefill(lease, keep_logits=False)
        lifecycle.prefill_done(lease)
        t0 = time.perf_counter()
        for i in range(steps):
            lifecycle.decode_step(lease.seq, (7 * i + 1) % llm.layout.vocab_size)
        return time.perf_counter() - t0
    finally:
        lifecycle.release(lease)


def _counts(llm: LLM, prompt: list[int]) -> dict[str, dict[str, int]]:
    """The collectives of one prefill of ``prompt`` and of one decode step, on this rank."""
    assert llm.ranks is not None
    group = llm.ranks.group
    before = Counter(group.counts)
    llm.prefill_logits(prompt)
    prefill = Counter(group.counts) - before
    lifecycle = llm.lifecycle
    lease = lifecycle.start(list(prompt), 1)
    try:
        lifecycle.prefill(lease, keep_logits=False)
        lifecycle.prefill_done(lease)
        before = Counter(group.counts)
        lifecycle.decode_step(lease.seq, 1)
        decode = Counter(group.counts) - before
    finally:
        lifecycle.release(lease)
    return {"prefill": dict(prefill), "decode_step": dict(decode)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_next-small")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    threads = max(1, (os.cpu_count() or 1) // 2)  # what the engine gives each worker at TP=2
    torch.set_num_threads(threads)
    cache = CacheConfig(max_prefill_chunk_tokens=512, enable_prefix_caching=False)
    print(f"loading {args.model} at TP=1 and TP=2 ...", file=sys.stderr)
    one = LLM(args.model, device="cpu", cache=cache)
    two = LLM(args.model, device="cpu", cache=cache, tensor_parallel_size=2)
    try:
        vocab = one.layout.vocab_size
        prompt = [(31 * i + 7) % vocab for i in range(args.prompt_tokens)]
        diff = (one.prefill_logits(prompt) - two.prefill_logits(prompt)).abs().max().item()  # also a warm-up
        prefill: dict[int, float] = {1: float("inf"), 2: float("inf")}
        decode: dict[int, float] = {1: float("inf"), 2: float("inf")}
        load_before = os.getloadavg()
        for r in range(args.repeats):
            for size, llm in ((1, one), (2, two)):
                t0 = time.perf_counter()
                llm.prefill_logits(prompt)
                prefill[size] = min(prefill[size], time.perf_counter() - t0)
                steps = two.on_every_rank(_decode, prompt, args.decode_steps)[0] if size == 2 else _decode(one, prompt, args.decode_steps)
                assert isinstance(steps, float)
                decode[size] = min(decode[size], steps / args.decode_steps)
            print(f"repeat {r + 1}/{args.repeats}: prefill {prefill}, decode step {decode}", file=sys.stderr)
        counts = two.on_every_rank(_counts, prompt[:64])[0]
        doc = {
            "benchmark": "tp",
            "model": args.model,
            "prompt_tokens": args.prompt_tokens,
            "decode_steps": args.decode_steps,
            "threads_per_rank": threads,
            "layers": len(one.layout.layer_types),
            "prefill_seconds": {"tp1": prefill[1], "tp2": prefill[2]},
            "decode_step_seconds": {"tp1": decode[1], "tp2": decode[2]},
            "prefill_ratio_tp2_over_tp1": prefill[2] / prefill[1],
            "decode_step_ratio_tp2_over_tp1": decode[2] / decode[1],
            "collectives_per_step": counts,
            "max_abs_logit_diff": diff,
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "machine": platform.machine(),
        }
        print(json.dumps(doc))
    finally:
        two.close()
        one.close()


if __name__ == "__main__":
    main()
