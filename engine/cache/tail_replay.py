"""The Tail-Replay plan for ``linear_state`` (off by default; ``CacheConfig.tail_replay``).

When a missing recurrent checkpoint holds L* back, the other forms' common resume point L is
taken instead and the linear layers' state is rebuilt by running the last R tokens from a zero
state: computation starts at L − R, where every other form must resume exactly too. R is
``replay_fraction``·L rounded up to U, clamped to [``replay_min_tokens``, ``replay_max_tokens``].

Source: "Tail-Replay: Escaping the Curse of Linear Attention in Prefix Caching for Hybrid LLMs"
(2026); DESIGN.md §4.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from engine.cache.config import CacheConfig
from engine.cache.coordinator import FormLookup, ResumableForm, ResumePlan, plan_resume
from engine.cache.forms import PagedKVForm
from engine.cache.hashing import BlockHash
from engine.cache.memory_plan import window_pages_needed
from engine.events import Form, Outcome, Reason


def replay_tokens(config: CacheConfig, point_tokens: int) -> int:
    """R for a resume at ``point_tokens``: ``replay_fraction``·L rounded up to U, clamped to
    [``replay_min_tokens``, ``replay_max_tokens``] rounded to multiples of U (up, down)."""
    u = config.unit_tokens
    low = -(-config.replay_min_tokens // u) * u
    high = max(u, config.replay_max_tokens - config.replay_max_tokens % u)
    return min(max(-(-math.ceil(config.replay_fraction * point_tokens) // u) * u, low), high)


def tail_replay_plan(
    exact: ResumePlan,
    forms: Sequence[ResumableForm],
    hashes: Sequence[BlockHash],
    total_tokens: int,
    hit_tokens: int,
    *,
    config: CacheConfig,
    kv_forms: Sequence[PagedKVForm],
) -> ResumePlan:
    """The Tail-Replay plan when it resumes further than ``exact``, else ``exact``.

    Args:
        exact: the exact plan over ``forms`` (every form, vetoed ones included).
        total_tokens: prompt plus output tokens the request may reach (its pages must fit).
        hit_tokens: the hash hit.
        kv_forms: the paged forms, whose pools must hold the replayed pages besides the
            matched ones.

    L = the point every form but ``linear_state`` agrees on; the other forms must resume
    exactly at L − R too (computation starts there, the linear layers from a zero state). Mode
    ``fallback``: only when L − R > the exact L* (no exact checkpoint within the budget);
    ``on`` / ``only``: whenever L > the exact L* and L − R > 0. Refused (``exact`` returned)
    when the replayed pages would not fit the full-KV pool or a window pool next to the pinned
    window.
    """
    u = config.unit_tokens
    others = [f for f in forms if f.form != Form.LINEAR_STATE]
    if not others:  # a linear-only model has nothing else to resume on
        return exact
    prompt_tokens = exact.prompt_tokens
    alt = plan_resume(others, hashes, prompt_tokens, hit_tokens, u)
    point = alt.resume_tokens
    replay = replay_tokens(config, point)  # a multiple of U
    start = point - replay
    if point <= exact.resume_tokens or start <= 0 or any(f.resume_at_most(hashes, start) != start for f in others):
        return exact
    if config.tail_replay == "fallback" and start <= exact.resume_tokens:
        return exact  # an exact checkpoint lies within the replay budget
    # the replayed rows go to new pages while the matched ones stay pinned: R/U pages more
    # than the request would hold otherwise; refuse rather than exhaust the full-KV pool
    full = [f for f in kv_forms if f.window is None]
    if full and -(-total_tokens // u) + replay // u > full[0].pool.num_blocks - 1:
        return exact
    for f in kv_forms:  # a window form also keeps its pinned window next to the working set
        if f.window is not None:
            pinned = len(f.needed_pages(point))
            if pinned + window_pages_needed(config, f.window, total_tokens - prompt_tokens) > f.pool.num_blocks - 1:
                return exact
    linear = exact.form(Form.LINEAR_STATE)
    replayed = FormLookup(
        form=Form.LINEAR_STATE,
        outcome=Outcome.REPLAYED,
        reason=linear.reason if linear.reason != Reason.NONE else Reason.LINEAR_CHECKPOINT_MISSING,
        usable_tokens=linear.usable_tokens,
        recoverable_tokens=0,  # no stored linear state was reused
        replayed_tokens=replay,
        reason_tokens=linear.reason_tokens,
    )
    verdicts = sorted([*alt.forms, replayed], key=lambda f: list(Form).index(f.form))
    plan = dataclasses.replace(alt, forms=tuple(verdicts), replayed_tokens=replay)
    if plan.limiting_form is None:  # what keeps recoverable below L: the replayed form
        plan = dataclasses.replace(plan, limiting_form=Form.LINEAR_STATE, limiting_reason=replayed.reason, limiting_forms=(Form.LINEAR_STATE,))
    return plan
