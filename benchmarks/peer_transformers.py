"""kvscope against transformers on the same weights, threads and prompts (one JSON object).

Both load ``engine/weights/qwen3_next-small`` (a trained Qwen3-Next layout; transformers'
``Qwen3NextForCausalLM`` on its torch path, no fla-core) in one dtype and run alternately, the
same number of torch threads for both:

* ``prefill``: a cold prompt of 2K and 8K tokens (held-out Tiny Shakespeare bytes, a fresh
  prompt per repeat so kvscope's prefix cache never hits). kvscope: ``LLM.generate`` with
  ``max_tokens=1`` through its whole engine (prefix cache on, its default checkpoints, chunks of
  ``--prefill-chunk-tokens``); transformers: one forward with its cache (``use_cache=True``), as its
  ``generate`` prefills. Figures are tokens/s and the ratio kvscope / transformers.
* ``decode``: 64 greedy tokens after a 256-token prompt, tokens/s of the decode alone (the
  time of 65 generated tokens less that of one), kvscope's ``generate`` against transformers'
  ``generate``.
* ``logits``: the last position's logits of the 2K prompt, max |Δ| and whether the top-1
  agrees, and the greedy continuations compared.

Median of ``--repeats`` alternating runs. The machine's CPU flags (avx2, avx512*, amx*) and
the load average are printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

MODEL = Path("engine/weights/qwen3_next-small")
TEXT = Path("../shared/data/text/tinyshakespeare/input.txt")


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def prompts(tokens: int, count: int) -> list[list[int]]:
    """``count`` distinct prompts of ``tokens`` held-out bytes (each starts one byte later)."""
    data = TEXT.read_bytes()[-(128 * 1024) :]
    return [list(data[i : i + tokens]) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=2048, help="kvscope's max_prefill_chunk_tokens (vLLM's online default budget)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from engine.cache.config import CacheConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths)
    blocks = 2 * longest // 16 + 64
    cache = CacheConfig(
        full_kv_blocks=blocks, swa_blocks=blocks, compressed_blocks=blocks, tail_slots=blocks, linear_checkpoints=2 * longest // 128 + 16,
        max_prefill_chunk_tokens=args.prefill_chunk_tokens,
    )  # fmt: skip
    ours = LLM(str(MODEL), device="cpu", cache=cache, dtype=args.dtype)
    peer = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype).eval()

    def kvscope_prefill(ids: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = ours.generate(ids, SamplingParams(max_tokens=1))[0]
        return time.perf_counter() - t0, out.output_token_ids[0]

    @torch.no_grad()
    def peer_prefill(ids: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        logits = peer(torch.tensor([ids]), use_cache=True, logits_to_keep=1).logits
        return time.perf_counter() - t0, int(logits[0, -1].argmax())

    results: dict[str, Any] = {"prefill": [], "decode": None, "logits": None}
    for length in lengths:
        ps = prompts(length, 2 * args.repeats + 1)
        kvscope_prefill(ps[-1])  # warm both at this length (allocator, kernels' first calls)
        peer_prefill(ps[-1])
        ours_s, peer_s, agree = [], [], 0
        for r in range(args.repeats):
            a, ta = kvscope_prefill(ps[2 * r])
            b, tb = peer_prefill(ps[2 * r])
            ours_s.append(a)
            peer_s.append(b)
            agree += ta == tb
        k, p = statistics.median(ours_s), statistics.median(peer_s)
        results["prefill"].append({
            "tokens": length, "kvscope_tokens_per_s": round(length / k, 1), "transformers_tokens_per_s": round(length / p, 1),
            "ratio": round(p / k, 3), "next_token_agreement": f"{agree}/{args.repeats}",
        })  # fmt: skip

    ids = prompts(256, 1)[0]
    n = args.decode_tokens

    @torch.no_grad()
    def peer_generate(tokens: int, prompt: list[int] = ids) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = peer.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        return time.perf_counter() - t0, out[0, len(prompt) :].tolist()

    def ours_generate(tokens: int, prompt: list[int] = ids) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = ours.generate(prompt, SamplingParams(max_tokens=tokens))[0]
        return time.perf_counter() - t0, list(out.output_token_ids)

    ours_d, peer_d = [], []
    for _ in range(args.repeats):
        ours_d.append(ours_generate(n + 1)[0] - ours_generate(1)[0])
        peer_d.append(peer_generate(n + 1)[0] - peer_generate(1)[0])
    fresh = list(TEXT.read_bytes()[-(128 * 1024) :][-256:])  # served by neither before: kvscope's a cold prefill too
    ours_tokens, peer_tokens = ours_generate(32, fresh)[1], peer_generate(32, fresh)[1]
    k, p = statistics.median(ours_d), statistics.median(peer_d)
    results["decode"] = {
        "tokens": n, "kvscope_tokens_per_s": round(n / k, 1), "transformers_tokens_per_s": round(n / p, 1), "ratio": round(p / k, 3),
        "greedy_top1_agreement_32": sum(a == b for a, b in zip(ours_tokens, peer_tokens, strict=True)) / 32,
    }  # fmt: skip
    with torch.no_grad():
        first = prompts(lengths[0], 1)[0]
        ours_logits = ours.prefill_logits(first)[-1].float()
        peer_logits = peer(torch.tensor([first])).logits[0, -1].float()
    results["logits"] = {
        "tokens": lengths[0], "max_abs_diff": float((ours_logits - peer_logits).abs().max()),
        "top1_equal": bool(ours_logits.argmax() == peer_logits.argmax()),
    }  # fmt: skip
    ours.close()
    print(json.dumps({
        "model": str(MODEL), "dtype": args.dtype, "threads": args.threads, "kvscope_prefill_chunk_tokens": args.prefill_chunk_tokens, "repeats": args.repeats, "cpu_flags": cpu_flags(),
        "loadavg": os.getloadavg(), **results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
