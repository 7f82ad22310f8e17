"""Time to first token for a matched prefix plus a new suffix: cold prefill, exact resume and
Tail-Replay at two budgets, side by side in one run, as speedups over cold; Tail-Replay quality
as KL divergence and top-1 agreement of the suffix's next-token distributions against the exact
resume. Prints one JSON object (``kvscope bench ttft --json`` prints the same object):

``{"model", "device", "text", "suffix_tokens", "results": [{"prefix_tokens", "plan", "ttft_seconds",
"speedup", "kl", "top1_agreement"}, ...]}`` with plan ∈ cold | exact | disk | replay_5 | replay_10.
``disk``: the prefix's state was offloaded to the disk tier and the engine restarted (the index
rebuilt from the files, the files dropped from the OS page cache with ``posix_fadvise``), so the
follow-up swaps every form in from disk before it resumes; its KL and top-1 agreement against the
exact resume check that the restore is exact.

Prompts are held-out bytes of Tiny Shakespeare (the last 128 KiB, never trained on): prefix =
P bytes, suffix = the next S bytes; the exact and replay follow-ups use the same prompt as the
cold run. One torch thread per run would be fairer to a busy machine but slower; the engines use
torch's default threads, all plans of one length run back to back.

Source of the Tail-Replay setting: "Tail-Replay: Escaping the Curse of Linear Attention in Prefix
Caching for Hybrid LLMs" (2026) — R = 5 % / 10 % of the matched prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.cache.config import CacheConfig

if TYPE_CHECKING:  # torch and the engine load when a benchmark runs, not when the CLI parses its flags
    import torch

    from engine.llm import LLM

HELD_OUT_BYTES = 128 * 1024
DEFAULT_TEXT = Path("../shared/data/text/tinyshakespeare/input.txt")
"""Relative to the repository root, where ``make`` and the benchmarks run."""
PLANS = ("cold", "exact", "disk", "replay_5", "replay_10")


def held_out(text: Path, need: int) -> list[int]:
    """The last 128 KiB of ``text`` (bytes = token ids), at least ``need`` of them.

    Raises:
        ValueError: the file is missing or too short.
    """
    if not text.is_file():
        raise ValueError(f"{text}: no such text file (give --text; the default is shared/data's Tiny Shakespeare)")
    data = text.read_bytes()[-HELD_OUT_BYTES:]
    if len(data) < need:
        raise ValueError(f"{text}: {len(data)} held-out bytes, the benchmark needs {need}")
    return list(data)


def cache_for(tokens: int, unit: int, linear_checkpoints: int, replay_fraction: float = 0.05) -> CacheConfig:
    """Pools holding a whole prompt of ``tokens`` in every form; checkpoints at every U boundary
    (so a replay start L − R has the windows and compressor rows it needs)."""
    pages = tokens // unit + tokens // unit // 8 + 64  # + the replayed rows' own pages
    return CacheConfig(
        unit_tokens=unit,
        full_kv_blocks=pages,
        swa_blocks=pages + 256,  # a request's sliding working set on top (chunk 2048)
        compressed_blocks=pages,
        tail_slots=pages,
        linear_checkpoints=linear_checkpoints,
        checkpoint_interval_tokens=unit,
        max_prefill_chunk_tokens=2048,
        tail_replay="fallback",
        replay_fraction=replay_fraction,
        replay_min_tokens=unit,
        replay_max_tokens=1 << 20,
    )


def timed_score(llm: LLM, ids: Sequence[int]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = llm.score(ids)
    return time.perf_counter() - t0, out


def quality(exact: torch.Tensor, replay: torch.Tensor) -> tuple[float, float]:
    """Mean KL(exact ‖ replay) in nats and top-1 agreement over the rows (suffix positions)."""
    p, q = exact.log_softmax(-1), replay.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    agree = (exact.argmax(-1) == replay.argmax(-1)).float().mean().item()
    return kl, agree


def drop_page_cache(directory: Path) -> None:
    """Ask the OS to forget the cached pages of every file under ``directory`` (written back
    first), so that reads come from the disk."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_row(
    model: str, device: str, data: list[int], prefix: int, ids: list[int], unit: int, cold_s: float, exact_rows: torch.Tensor, suffix_tokens: int
) -> dict[str, Any]:
    """The ``disk`` plan: serve the prefix, offload every object to the disk tier, restart the
    engine on the same directory, then time the follow-up (swap-in + resume)."""
    from engine.llm import LLM

    with tempfile.TemporaryDirectory(prefix="kvscope-bench-disk-") as where:
        config = dataclasses.replace(
            cache_for(len(ids), unit, len(ids) // unit + 8), tail_replay="off", disk_tier_bytes=1 << 40, disk_tier_dir=where
        )
        with LLM(model, device=device, cache=config) as writer:
            writer.score(data[:prefix])
            writer.offload("disk")
        drop_page_cache(Path(where))
        with LLM(model, device=device, cache=config) as reader:
            reader.calibrate()  # the admission's cost model, measured before the clock starts
            disk_s, out = timed_score(reader, ids)
    if out.cache.admission != "swap_in":
        print(f"warning: disk at {prefix}: admission chose {out.cache.admission} (L* = {out.resume_tokens})", file=sys.stderr)
    kl, agree = quality(exact_rows, out.logits[-suffix_tokens:])
    return {
        "prefix_tokens": prefix,
        "plan": "disk",
        "ttft_seconds": disk_s,
        "speedup": cold_s / disk_s,
        "kl": kl,
        "top1_agreement": agree,
        "admission": str(out.cache.admission),
        "predicted_seconds": out.cache.predicted_seconds,
        "bytes_moved": sum(f.bytes_moved for f in out.forms),
    }


def run(model: str, prefixes: Sequence[int], suffix_tokens: int, text: Path, device: str, plans: Sequence[str] = PLANS) -> dict[str, Any]:
    """Every plan of ``plans`` at every prefix length; ``cold`` and ``exact`` always run (the
    other plans' speedups and quality are measured against them).

    Raises:
        ValueError: the text is missing or too short, or a plan is not one of :data:`PLANS`.
    """
    from engine.llm import LLM

    unknown = sorted(set(plans) - set(PLANS))
    if unknown:
        raise ValueError(f"unknown plan(s) {', '.join(unknown)}; the plans are {', '.join(PLANS)}")
    data = held_out(text, max(prefixes) + suffix_tokens)
    results: list[dict[str, Any]] = []
    for prefix in prefixes:
        ids = data[:prefix] + data[prefix : prefix + suffix_tokens]
        cold_llm = LLM(model, device=device, cache=dataclasses.replace(CacheConfig(), enable_prefix_caching=False, full_kv_blocks=len(ids) // 16 + 64, swa_blocks=len(ids) // 16 + 256))  # fmt: skip
        unit = cold_llm.cache_config.unit_tokens
        cold_s, _ = timed_score(cold_llm, ids)
        del cold_llm
        # exact: the prefix was served before (its state stored at P); the follow-up resumes at P
        exact_llm = LLM(model, device=device, cache=dataclasses.replace(cache_for(len(ids), unit, len(ids) // unit + 8), tail_replay="off"))
        exact_llm.score(data[:prefix])
        exact_s, exact_out = timed_score(exact_llm, ids)
        if exact_out.resume_tokens != prefix - unit * (prefix % unit != 0):
            print(f"warning: exact resume at {exact_out.resume_tokens}, prefix {prefix}", file=sys.stderr)
        exact_rows = exact_out.logits[-suffix_tokens:]
        del exact_llm
        rows = [
            {"prefix_tokens": prefix, "plan": "cold", "ttft_seconds": cold_s, "speedup": 1.0, "kl": None, "top1_agreement": None},
            {"prefix_tokens": prefix, "plan": "exact", "ttft_seconds": exact_s, "speedup": cold_s / exact_s, "kl": 0.0, "top1_agreement": 1.0},
        ]
        if "disk" in plans:
            rows.append(disk_row(model, device, data, prefix, ids, unit, cold_s, exact_rows, suffix_tokens))
        replays = [(plan, fraction) for plan, fraction in (("replay_5", 0.05), ("replay_10", 0.10)) if plan in plans]
        if not replays:
            results.extend(rows)
            print(f"prefix {prefix}: " + ", ".join(f"{r['plan']} {r['ttft_seconds']:.2f}s" for r in rows), file=sys.stderr)
            continue
        # Tail-Replay: the recurrent checkpoints are gone (a 2-slot pool), everything else is kept
        replay_llm = LLM(model, device=device, cache=cache_for(len(ids), unit, 2))
        replay_llm.score(data[:prefix])
        replay_llm.score(data[prefix + suffix_tokens : prefix + suffix_tokens + 4 * unit])  # takes the last slot
        for plan, fraction in replays:
            replay_llm.cache.config = dataclasses.replace(replay_llm.cache.config, replay_fraction=fraction)
            replay_s, out = timed_score(replay_llm, ids)
            if not out.approximate:
                print(f"warning: {plan} at {prefix}: no replay happened (L* = {out.resume_tokens})", file=sys.stderr)
            kl, agree = quality(exact_rows, out.logits[-suffix_tokens:])
            rows.append(
                {
                    "prefix_tokens": prefix,
                    "plan": plan,
                    "ttft_seconds": replay_s,
                    "speedup": cold_s / replay_s,
                    "kl": kl,
                    "top1_agreement": agree,
                    "replayed_tokens": out.cache.replayed_tokens,
                }
            )
        del replay_llm
        results.extend(rows)
        print(f"prefix {prefix}: " + ", ".join(f"{r['plan']} {r['ttft_seconds']:.2f}s" for r in rows), file=sys.stderr)
    return {
        "model": model,
        "device": device,
        "text": str(text),
        "suffix_tokens": suffix_tokens,
        "results": results,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="kvscope_hybrid-small", help="preset or model directory (default: %(default)s)")
    p.add_argument("--prefix-tokens", type=int, nargs="+", default=[8192, 16384, 32768], help="matched prefix lengths (default: %(default)s)")
    p.add_argument("--suffix-tokens", type=int, default=256, help="new tokens after the prefix (default: %(default)s)")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="held-out text (default: shared/data Tiny Shakespeare)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS), help="plans to time; cold and exact always run (default: all)")
    p.add_argument("--json", action="store_true", help="print only the JSON object (always the case here)")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks.ttft`` (the same as ``kvscope bench ttft --json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        doc = run(args.model, args.prefix_tokens, args.suffix_tokens, args.text, args.device, args.plans)
    except ValueError as exc:
        print(f"ttft: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(doc))
