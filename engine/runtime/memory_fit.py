"""Whether a waiting request fits beside the running ones (vLLM's ``can_allocate``)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.cache import PrefixCache
from engine.cache.block_pool import SENTINEL_BLOCK
from engine.cache.forms import PagedKVForm
from engine.runtime.request import RuntimeRequest


def pages_needed(cache: PrefixCache, r: RuntimeRequest, form: PagedKVForm) -> int:
    """Pages of ``form`` that ``r`` will hold through its prompt and next token — and, once it
    has been preempted, through all of its output, so it is not preempted again and again —
    all of them for a full-KV form, the most one request holds for a window form."""
    if form.window is None:
        tokens = r.num_tokens + (r.params.max_tokens - len(r.output_token_ids) if r.num_preemptions else 0)
        return -(-tokens // cache.unit_tokens) + 1
    return cache.window_pages_needed(form.window, r.params.max_tokens - len(r.output_token_ids))


def fits(cache: PrefixCache, running: Sequence[RuntimeRequest], r: RuntimeRequest) -> bool:
    """Whether every KV pool can hold ``r``'s pages (:func:`pages_needed`) besides what the
    ``running`` requests will still allocate, counting cached pages as evictable.
    Conservative: pages ``r`` would reuse from the cache count too."""
    for form in cache.kv_forms:
        outstanding = 0
        for other in running:
            held = sum(1 for b in other.seq.tables[form] if b != SENTINEL_BLOCK) if other.seq is not None else 0
            outstanding += max(1, pages_needed(cache, other, form) - held)
        available = form.pool.num_blocks - 1 - form.pool.num_leased - outstanding
        if pages_needed(cache, r, form) > available:
            return False
    return True
