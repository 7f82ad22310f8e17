"""Prefix-cache lookup cost at 32K tokens, and the memory each cache form takes per context length.

Two measurements of the trained hybrid (``kvscope_hybrid-small``: linear, sliding, CSA, full and
HCA layers, so all six forms exist), side by side in one run:

1. **Lookup cost.** The cache is warmed by one 32K-token request (``llm.score``); then, on one
   torch thread and with ``time.perf_counter_ns`` over many repetitions, for a follow-up request
   (the same prompt plus a few new tokens):

   * ``PrefixCache.block_hashes(ids)`` — the hash chain (reported apart);
   * ``PrefixCache.lookup(hashes, len(ids))`` — hash hit, validation layers 2 and 4, and the
     coordinator's fixed point over every form (layers 1 and 3) — given the precomputed hashes.

   The same lookup is timed for a diverging follow-up that shares only about half of the prefix.
   Each result carries L* and every form's usable tokens (proof that the lookup did real work),
   the median time of one ``resume_at_most`` call per form at the hash hit, and how many such
   calls the fixed point made. Target: a median lookup under 1 ms.

2. **Memory per form** at 8K, 32K and 128K tokens of context, from the cache's own geometry
   (each pool's ``bytes_per_block`` and the blocks / slots one sequence of that length needs):
   ``full_kv`` pages ``⌈L/U⌉``; ``swa_window`` the window pages a request holds
   (``⌈W/U⌉ + 1``); ``compressed_kv`` and indexer key pages ``⌊L/r⌋·r / max(U, r)`` per
   compressor geometry; ``uncompressed_tail``, indexer pending rows and ``linear_state`` one slot
   per checkpoint position of a cold prompt of L tokens. Nothing is prefilled for this part.

Prints one JSON object on stdout; progress goes to stderr. No timed assertion: absolute times on
a shared machine are context, the target is reported, not enforced.

Run: ``python -m benchmarks.cache_lookup`` from the repository root (as a module: run as a file,
``benchmarks/kernels.py`` would shadow the ``kernels`` package);
``--profile`` adds a cProfile listing of the lookup's top functions on stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import logging
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine import LLM
from engine.cache import CacheConfig, PrefixCache, ResumePlan
from engine.cache.compressed import BoundarySlots, EntryPages
from engine.cache.coordinator import ResumableForm, plan_resume, resume_limit
from engine.cache.hashing import BlockHash
from engine.events import Form, Reason

log = logging.getLogger("benchmarks.cache_lookup")

MODEL = "kvscope_hybrid-small"
TARGET_LOOKUP_US = 1000
MEMORY_CONTEXT_TOKENS = (8 * 1024, 32 * 1024, 128 * 1024)


# -- setup ------------------------------------------------------------------------------------------
def cache_config(prompt_tokens: int, unit_tokens: int, checkpoint_interval_tokens: int) -> CacheConfig:
    """Pools that hold a whole ``prompt_tokens`` prefix in every form, with a margin, so the
    warm request evicts nothing (one id per pool is the sentinel)."""
    chunk_tokens = 2048
    pages = -(-prompt_tokens // unit_tokens) + 64
    checkpoints = prompt_tokens // checkpoint_interval_tokens + 16
    return CacheConfig(
        unit_tokens=unit_tokens,
        full_kv_blocks=pages,
        # a request may also hold one prefill chunk and an interval beyond its window
        swa_blocks=pages + (chunk_tokens + checkpoint_interval_tokens) // unit_tokens,
        compressed_blocks=pages,
        linear_checkpoints=checkpoints,
        tail_slots=checkpoints,
        checkpoint_interval_tokens=checkpoint_interval_tokens,
        max_prefill_chunk_tokens=chunk_tokens,
    )


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


# -- timing -----------------------------------------------------------------------------------------
def time_us(
    fn: Callable[..., object], repeats: int, warmup: int = 3, setup: Callable[[], object] | None = None
) -> dict[str, float]:
    """Median and p90 (microseconds) of ``repeats`` calls of ``fn``, after ``warmup`` calls.

    With ``setup``, each call is ``fn(setup())`` and only ``fn`` is timed: the lookup takes a
    fresh copy of the hash chain every time, as a new request brings its own (the cache memoises
    per chain within one lookup, and must not be timed on a chain it has already seen)."""

    def once() -> int:
        arg = setup() if setup is not None else None
        t0 = time.perf_counter_ns()
        fn(arg) if setup is not None else fn()
        return time.perf_counter_ns() - t0

    for _ in range(warmup):
        once()
    samples_ns = [once() for _ in range(repeats)]
    p90 = statistics.quantiles(samples_ns, n=10)[8] if len(samples_ns) > 1 else samples_ns[0]
    return {"median": round(statistics.median(samples_ns) / 1000, 1), "p90": round(p90 / 1000, 1)}


class _CountingForm:
    """Wraps a cache form and counts the coordinator's ``resume_at_most`` calls."""

    def __init__(self, inner: ResumableForm) -> None:
        self.inner = inner
        self.calls = 0

    @property
    def form(self) -> Form:
        return self.inner.form

    @property
    def downward_closed(self) -> bool:
        return self.inner.downward_closed

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        self.calls += 1
        return self.inner.resume_at_most(hashes, limit_tokens)

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        return self.inner.loss_reason(hashes, resume_tokens)


def plan_summary(plan: ResumePlan) -> dict[str, Any]:
    return {
        "prompt_tokens": plan.prompt_tokens,
        "hash_hit_tokens": plan.hash_hit_tokens,
        "resume_tokens": plan.resume_tokens,
        "limiting_form": plan.limiting_form.value if plan.limiting_form is not None else None,
        "limiting_reason": plan.limiting_reason.value,
        "forms": {
            f.form.value: {"outcome": f.outcome.value, "reason": f.reason.value, "usable_tokens": f.usable_tokens}
            for f in plan.forms
        },
    }


def measure_lookup(cache: PrefixCache, ids: Sequence[int], repeats: int) -> dict[str, Any]:
    """Time ``lookup`` (hashes precomputed) for one prompt, with where its time goes."""
    hashes = cache.block_hashes(ids)
    plan = cache.lookup(hashes, len(ids))
    fresh = functools.partial(list, hashes)
    lookup = time_us(lambda h: cache.lookup(h, len(ids)), repeats, setup=fresh)
    target = min(plan.hash_hit_tokens, resume_limit(len(ids), cache.unit_tokens))
    parts = {
        "prefix_index.hit_blocks": time_us(lambda: cache.index.hit_blocks(hashes), repeats)["median"],
        "validation_failures": time_us(cache.validation_failures, repeats)["median"],
    }
    for f in cache.forms:
        resume_at_most = functools.partial(lambda form, h: form.resume_at_most(h, target), f)
        parts[f"{f.form.value}.resume_at_most"] = time_us(resume_at_most, repeats, setup=fresh)["median"]
    counting = [_CountingForm(f) for f in cache.forms]
    plan_resume(counting, hashes, len(ids), plan.hash_hit_tokens, cache.unit_tokens)
    return {
        **plan_summary(plan),
        "lookup_us_median": lookup["median"],
        "lookup_us_p90": lookup["p90"],
        "meets_target": lookup["median"] < TARGET_LOOKUP_US,
        "component_us_median": parts,
        "fixed_point_resume_at_most_calls": {c.form.value: c.calls for c in counting},
    }


def profile_lookup(cache: PrefixCache, ids: Sequence[int], repeats: int, top: int = 15) -> str:
    """cProfile listing (by internal time) of ``repeats`` lookups."""
    hashes = cache.block_hashes(ids)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        cache.lookup(list(hashes), len(ids))  # a fresh chain, as a new request brings
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# -- memory -----------------------------------------------------------------------------------------
def checkpoint_positions(cache: PrefixCache, context_tokens: int) -> frozenset[int]:
    """Where a cold prompt of ``context_tokens`` stores checkpoints (the engine's own rule)."""
    cold = ResumePlan(
        prompt_tokens=context_tokens,
        hash_hit_tokens=0,
        resume_tokens=0,
        limiting_form=None,
        limiting_reason=Reason.NO_PREFIX_MATCH,
        forms=(),
    )
    return cache.checkpoint_positions(cold)


def form_memory(cache: PrefixCache, context_tokens: int) -> dict[str, Any]:
    """Blocks (pages or slots) per pool and bytes per form that one sequence of
    ``context_tokens`` holds."""
    u = cache.unit_tokens
    positions = checkpoint_positions(cache, context_tokens)
    blocks: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for kv in cache.kv_forms:
        if kv.window is None:
            pages = -(-context_tokens // u)
        else:  # the working set of a request: the window plus the page being written
            pages = min(-(-kv.window // u) + 1, -(-context_tokens // u))
        blocks[kv.pool.name] = pages
        nbytes[kv.form.value] = pages * kv.bytes_per_block
    entry_forms: list[tuple[Form, Sequence[EntryPages], Sequence[BoundarySlots]]] = []
    if cache.compressed is not None:
        entry_forms.append((Form.COMPRESSED_KV, cache.compressed.groups, []))
    if cache.tail is not None:
        entry_forms.append((Form.UNCOMPRESSED_TAIL, [], [cache.tail.slots]))
    if cache.indexer is not None:
        entry_forms.append((Form.INDEXER_STATE, cache.indexer.keys, [cache.indexer.slots]))
    for form, groups, slot_pools in entry_forms:
        nbytes[form.value] = 0
        for g in groups:
            blocks[g.pool.name] = g.pages_needed(context_tokens)
            nbytes[form.value] += blocks[g.pool.name] * g.bytes_per_block
        for slots in slot_pools:
            blocks[slots.pool.name] = sum(1 for p in positions if slots.needed_at(p))
            nbytes[form.value] += blocks[slots.pool.name] * slots.bytes_per_block
    if cache.linear is not None:
        blocks[cache.linear.pool.name] = len(positions)
        nbytes[Form.LINEAR_STATE.value] = len(positions) * cache.linear.bytes_per_block
    return {
        "checkpoint_positions": len(positions),
        "blocks": blocks,
        "bytes": nbytes,
        "total_bytes": sum(nbytes.values()),
    }


def memory_report(cache: PrefixCache, sliding_window: int | None) -> dict[str, Any]:
    """Per-form and per-pool geometry, one-slot sizes, and :func:`form_memory` per context."""
    pools: dict[str, dict[str, int]] = {}
    for kv in cache.kv_forms:
        pools[kv.pool.name] = {"bytes_per_block": kv.bytes_per_block, "tokens_per_block": kv.unit_tokens}
    entry_groups = [*(cache.compressed.groups if cache.compressed else []), *(cache.indexer.keys if cache.indexer else [])]
    for g in entry_groups:
        pools[g.pool.name] = {"bytes_per_block": g.bytes_per_block, "tokens_per_block": g.page_tokens}
    one_slot = {}
    for slots in (cache.tail.slots if cache.tail else None, cache.indexer.slots if cache.indexer else None):
        if slots is not None:
            one_slot[slots.pool.name] = slots.bytes_per_block
    if cache.linear is not None:
        one_slot[cache.linear.pool.name] = cache.linear.bytes_per_block
    return {
        "unit_tokens": cache.unit_tokens,
        "checkpoint_interval_tokens": cache.config.checkpoint_interval_tokens,
        "sliding_window_tokens": sliding_window,
        "bytes_per_block": {f.form.value: f.bytes_per_block for f in cache.forms},
        "pools": pools,
        "one_slot_bytes": one_slot,
        "by_context_tokens": {str(n): form_memory(cache, n) for n in MEMORY_CONTEXT_TOKENS},
    }


# -- main -------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=32 * 1024)
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens the follow-up adds")
    parser.add_argument("--checkpoint-interval-tokens", type=int, default=CacheConfig().checkpoint_interval_tokens)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="cProfile the lookup (listing on stderr)")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.INFO)

    unit_tokens = CacheConfig().unit_tokens
    config = cache_config(args.prompt_tokens, unit_tokens, args.checkpoint_interval_tokens)
    llm = LLM(args.model, device=args.device, cache=config)
    cache = llm.cache
    vocab = llm.layout.vocab_size
    rng = random.Random(0)
    prompt = random_tokens(rng, args.prompt_tokens, vocab)
    follow_up = prompt + random_tokens(rng, args.new_tokens, vocab)
    # shares half the prompt plus 40 tokens: the hash hit ends between checkpoints
    shared = args.prompt_tokens // 2 + 40
    diverging = prompt[:shared] + random_tokens(rng, len(follow_up) - shared, vocab)

    log.info("warming the cache with one %d-token request on %s", len(prompt), llm.device)
    t0 = time.perf_counter()
    warm = llm.score(prompt)
    warm_seconds = time.perf_counter() - t0
    log.info("warm request: %.1f s, resume at %d", warm_seconds, warm.cache.resume_tokens)

    torch.set_num_threads(1)
    hashes = cache.block_hashes(follow_up)
    hash_us = time_us(lambda: cache.block_hashes(follow_up), args.repeats)
    log.info("timing lookups (%d repeats each)", args.repeats)
    lookup = measure_lookup(cache, follow_up, args.repeats)
    diverging_lookup = measure_lookup(cache, diverging, args.repeats)
    if args.profile:
        print(profile_lookup(cache, follow_up, args.repeats), file=sys.stderr)

    result = {
        "benchmark": "cache_lookup",
        "model": llm.model_name,
        "device": str(llm.device),
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "warm_prefill_seconds": round(warm_seconds, 1),
        "target_lookup_us": TARGET_LOOKUP_US,
        "follow_up": {
            "hash_blocks": len(hashes),
            "hash_us_median": hash_us["median"],
            "hash_us_p90": hash_us["p90"],
            **lookup,
        },
        "diverging_follow_up": {"shared_prefix_tokens": shared, **diverging_lookup},
        "lookup_us_median": lookup["lookup_us_median"],
        "lookup_us_p90": lookup["lookup_us_p90"],
        "hash_us_median": hash_us["median"],
        "meets_target": lookup["meets_target"],
        "lookup_over_target": round(lookup["lookup_us_median"] / TARGET_LOOKUP_US, 2),
        "memory": memory_report(cache, llm.layout.sliding_window),
    }
    print(json.dumps(result, indent=2))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
