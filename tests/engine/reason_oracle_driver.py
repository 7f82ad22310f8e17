"""Random scenarios for the reason oracle: one ``engine.LLM`` with small pools driven through
requests, batches of plain lookups, offloads, prefetches, restarts and concurrent runtime
batches; every lookup and every request compared with the oracle (INDEPENDENCE: as
:mod:`tests.engine.reason_oracle`; this module only drives the engine's public API and feeds
snapshots to the oracle)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from engine import LLM, CacheConfig, SamplingParams
from engine.cache import tier_copies
from engine.cache.admission import CostModel
from engine.cache.hashing import BlockHash
from engine.cache.lifecycle import BlockState
from engine.events import Form, Reason, Tier
from engine.faults import Faults
from engine.request_lifecycle import RequestTooLarge
from engine.runtime import Runtime, SchedulerConfig
from engine.telemetry import ListSink
from tests.engine.reason_oracle_compare import Tally, compare, from_events, from_plan
from tests.engine.reason_oracle_plans import Expected, View, device_plan, request_plan
from tests.engine.reason_oracle_state import Snapshot, snapshot
from tests.helpers import TOLERANCE, assert_no_leases
from tests.helpers import tokens as rand_tokens

U = 16
FAMILIES = ("kvscope_hybrid-tiny", "qwen3_next-tiny", "deepseek_v4-tiny")
FAST = CostModel(seconds_per_token=1e-3, tier_bytes_per_second={Tier.HOST: 1e12, Tier.DISK: 1e12})
SLOW = CostModel(seconds_per_token=1e-3, tier_bytes_per_second={Tier.HOST: 1e5, Tier.DISK: 1e4})
"""Swap-ins of more than a few KB dearer than recompute: ``admission_recompute_cheaper``."""
"""Swap-ins far cheaper than recompute: the admission's choice is deterministic."""
FAULTS = (
    "none",
    "drop_tail",
    "lag_index",
    "evict_between_check_and_use",
    "groups_disagree",
    "corrupt_offloaded_file",
    "read_during_swap_in",
)
PREFIX_LENGTHS = (16, 31, 32, 48, 63, 64, 80, 96, 112, 128, 144, 160)
SUFFIX_LENGTHS = (0, 1, 5, 16, 17, 31, 33)


@dataclass(frozen=True, slots=True)
class Scenario:
    model: str
    cache: dict[str, object]
    tiers: str
    """``none``, ``host`` or ``host+disk``."""
    fault: str
    prefixes: tuple[tuple[int, int], ...]
    """(length, seed) of each shared prefix."""
    ops: tuple[tuple[object, ...], ...]
    lookups_per_batch: int
    slow_tiers: bool = False
    """Price the tiers with :data:`SLOW` (else :data:`FAST`: swap-ins far cheaper)."""


@st.composite
def scenarios(draw: st.DrawFn, lookups_per_batch: int = 40) -> Scenario:
    model = draw(st.sampled_from(FAMILIES))
    tiers = draw(st.sampled_from(("none", "host", "host+disk", "host", "host+disk")))
    fault = draw(st.sampled_from(FAULTS))
    if fault in ("corrupt_offloaded_file", "read_during_swap_in") and tiers != "host+disk":
        disk = fault == "corrupt_offloaded_file"
        tiers = "host+disk" if disk else draw(st.sampled_from(("host", "host+disk")))
    cache: dict[str, object] = {
        "unit_tokens": U,
        "checkpoint_interval_tokens": draw(st.sampled_from([32, 48, 64])),
        "max_prefill_chunk_tokens": draw(st.sampled_from([32, 64])),
        "full_kv_blocks": draw(st.integers(24, 40)),
        "swa_blocks": draw(st.integers(18, 26)),
        "linear_checkpoints": draw(st.integers(3, 6)),
        "compressed_blocks": draw(st.integers(4, 24)),
        "tail_slots": draw(st.integers(2, 6)),
        "tail_replay": draw(st.sampled_from(["off", "off", "fallback", "on"])),
        "replay_min_tokens": 16, "replay_max_tokens": 64, "replay_fraction": 0.1,
        "swap_in_wait": fault != "read_during_swap_in" or draw(st.booleans()),
    }  # fmt: skip
    if tiers != "none":
        cache["host_tier_bytes"] = draw(st.sampled_from([96 << 10, 4 << 20, 4 << 20]))
        cache["max_recovery_bytes"] = draw(st.sampled_from([None, None, None, 2 << 10, 48 << 10]))
    if tiers == "host+disk":
        cache["disk_tier_bytes"] = 16 << 20
    n = draw(st.integers(1, 3))
    prefixes = tuple((draw(st.sampled_from(PREFIX_LENGTHS)), draw(st.integers(0, 2**16)) + 1000 * i) for i in range(n))
    kinds = ["score", "score", "generate", "followup", "followup", "lookups", "runtime", "validate"]
    kinds += ["offload", "prefetch", "prefetch", "drop", "drop", "followup"] if tiers != "none" else []
    kinds += ["restart"] if tiers == "host+disk" else []
    cut = st.one_of(st.sampled_from(["all", "all-1", "aligned"]), st.integers(0, 160))
    op = st.tuples(st.sampled_from(kinds), st.integers(0, n - 1), cut, st.sampled_from(SUFFIX_LENGTHS),
                   st.integers(0, 2**16), st.integers(1, 6))  # fmt: skip
    ops = tuple(draw(st.lists(op, min_size=4, max_size=12)))
    slow = tiers != "none" and draw(st.sampled_from([False, False, False, True]))
    return Scenario(model, cache, tiers, fault, prefixes, ops, lookups_per_batch, slow)


@dataclass(slots=True)
class Run:
    """One scenario's engine, its events and what was compared."""

    scenario: Scenario
    directory: Path
    tally: Tally = field(default_factory=Tally)
    sink: ListSink = field(default_factory=ListSink)
    llm: LLM | None = None
    prefixes: list[list[int]] = field(default_factory=list)
    history: list[list[int]] = field(default_factory=list)
    admits: dict[tuple[int, ...], tuple[Snapshot, int, CostModel | None, dict[Form, Reason]]] = field(
        default_factory=dict
    )
    """Per prompt, what its last admission started from: the snapshot, max tokens, the cost
    model and the vetoes it was given."""
    vetoes: dict[Form, Reason] = field(default_factory=dict)
    """Validation failures the driver injected (forms no plan may resume)."""
    last_ids: tuple[int, ...] = ()
    """The prompt the cache last hashed (what an admission is called for next)."""
    opened: int = 0
    """Engines opened so far (each restart names its requests anew)."""

    def label(self, what: str) -> str:
        s = self.scenario
        slow = " slow-tiers" if s.slow_tiers else ""
        return f"{s.model} tiers={s.tiers}{slow} fault={s.fault} replay={s.cache['tail_replay']} {what}"

    def config(self) -> CacheConfig:
        extra = (
            {"disk_tier_dir": str(self.directory / "tiers")}
            if self.scenario.tiers == "host+disk"
            else {}
        )
        return CacheConfig(**(self.scenario.cache | extra))  # type: ignore[arg-type]

    def faults(self) -> Faults:
        f = self.scenario.fault
        return Faults() if f == "none" else Faults(**{f: True})

    def open(self) -> LLM:
        llm = LLM(self.scenario.model, device="cpu", cache=self.config(), telemetry=self.sink, engine_id=f"oracle{self.opened}",
                  check_invariants=True, faults=self.faults(), cost_model=SLOW if self.scenario.slow_tiers else FAST)  # fmt: skip
        admit = llm.cache.admit

        def recording_admit(
            hashes: Sequence[BlockHash], prompt_tokens: int, costs: CostModel | None, *,
            output_tokens: int = 0, vetoes: Mapping[Form, Reason] | None = None,
        ) -> Any:  # fmt: skip (the planner's Admitted)
            self.settle(llm)
            ids = self.last_ids
            assert len(ids) == prompt_tokens and len(hashes) == prompt_tokens // U
            self.admits[ids] = (snapshot(llm, ids), output_tokens, costs, dict(vetoes or {}))
            return admit(hashes, prompt_tokens, costs, output_tokens=output_tokens, vetoes=vetoes)

        block_hashes = llm.cache.block_hashes

        def remembering_hashes(token_ids: Sequence[int]) -> list[BlockHash]:
            self.last_ids = tuple(token_ids)
            return block_hashes(token_ids)

        llm.cache.admit = recording_admit  # type: ignore[method-assign]
        llm.cache.block_hashes = remembering_hashes  # type: ignore[method-assign]
        self.llm = llm
        self.opened += 1
        return llm

    def settle(self, llm: LLM) -> None:
        """Finish what the admission's own settle would (so the snapshot sees the same state)."""
        llm.cache.settle()
        if llm.cache.tiers is not None:
            llm.cache.tiers.flush()

    def prompt(self, op: tuple[object, ...], seed_shift: int = 0) -> list[int]:
        _, prefix_i, cut, suffix, seed, _ = op
        base = self.prefixes[int(prefix_i)]  # type: ignore[call-overload]
        if cut == "all":
            n = len(base)
        elif cut == "all-1":
            n = len(base) - 1
        elif cut == "aligned":
            n = len(base) - len(base) % U
        else:
            n = min(int(cut), len(base))  # type: ignore[call-overload]
        ids = base[:n] + rand_tokens(int(suffix), int(seed) + seed_shift)  # type: ignore[call-overload]
        return ids or rand_tokens(1, int(seed))  # type: ignore[call-overload]

    # -- comparing ---------------------------------------------------------------------------
    def check_request(self, request_id: str, ids: Sequence[int]) -> None:
        key = tuple(ids)
        if key not in self.admits:  # preempted: admitted again with its outputs so far
            key = next(k for k in reversed(self.admits) if k[: len(ids)] == key)
        snap, max_tokens, costs, vetoes = self.admits.pop(key)
        assert self.llm is not None
        expected = request_plan(
            snap, len(key), self.llm.cache_config, costs, self.faults(), vetoes, max_tokens
        )
        answer = from_events(self.sink.events, request_id)
        label = self.label(f"request {request_id} T={len(key)} vetoes={list(map(str, vetoes))}")
        self.tally.add(answer, expected, compare(answer, expected, label))
        self.tally.seen[f"request:{'hit' if expected.plan.hit else 'no hit'} {kind_of(expected)}"] += 1

    def lookups(self, op: tuple[object, ...], count: int = 0, ids: Sequence[int] = ()) -> None:
        """A batch of plain lookups (``PrefixCache.lookup``: plans, changes nothing): cuts of the
        prefixes and of earlier prompts, with random suffixes (``ids`` first, when given)."""
        llm = self.llm
        assert llm is not None
        for i in range(count or self.scenario.lookups_per_batch):
            if i == 0 and ids:
                ids = list(ids)
            elif i % 3 == 0 and self.history:
                ids = self.history[i % len(self.history)][: 8 + 7 * i] + rand_tokens(i % 5, i)
            elif i % 3 == 1:
                ids = self.prefixes[i % len(self.prefixes)][: 10 + 9 * i] + rand_tokens(i % 7, i)
            else:
                ids = self.prompt(op, seed_shift=i)
            ids = ids or [1]
            snap = snapshot(llm, ids)
            plan = llm.cache.lookup(llm.cache.block_hashes(ids), len(ids))
            expected = Expected(device_plan(View(snap, vetoes=dict(self.vetoes)), len(ids), llm.cache_config))
            answer = from_plan(plan)
            self.tally.add(answer, expected, compare(answer, expected, self.label(f"lookup T={len(ids)}")))

    # -- the operations ------------------------------------------------------------------------
    def tier(self, op: tuple[object, ...]) -> Tier:
        return Tier.DISK if self.scenario.tiers == "host+disk" and int(op[4]) % 2 else Tier.HOST  # type: ignore[call-overload]

    def drop(self, ids: Sequence[int], seed: int, in_flight: bool = False, deep: bool = False) -> None:
        """Drop one tier entry of ``ids``' chain (``TierStore.drop``: its device copy declared
        wrong); with ``in_flight`` one being swapped in (refused when its copy ends)."""
        llm = self.llm
        assert llm is not None
        tiers = llm.cache.tiers
        if tiers is None:
            return
        chain = {h: i for i, h in enumerate(llm.cache.block_hashes(ids))}
        keys = sorted(
            (pool, chain[h], h)
            for (pool, h), e in tiers.entries.items()
            if h in chain and (tiers.states[e.row] is BlockState.SWAPPING_IN) == in_flight
        )
        if deep:  # the deepest entry of one pool
            pools = sorted({k[0] for k in keys})
            keys = [max(k for k in keys if k[0] == pools[seed % len(pools)])] if pools else []
        if keys:
            pool, _, h = keys[seed % len(keys)]
            tiers.drop(pool, h)
            self.tally.seen[f"op:drop {'in flight' if in_flight else 'at rest'}"] += 1

    def validate(self, op: tuple[object, ...]) -> None:
        """A batch of lookups while a validation layer fails (layer 2: another stored model
        revision for every form, or a pool tensor of another dtype for the first paged form)."""
        llm = self.llm
        assert llm is not None
        cache = llm.cache
        if int(op[4]) % 2:  # type: ignore[call-overload]
            revision = cache.stored_revision
            cache.stored_revision = "other-weights"
            self.vetoes = {f.form: Reason.MODEL_REVISION_CHANGED for f in cache.forms}
            try:
                self.lookups(op)
            finally:
                cache.stored_revision, self.vetoes = revision, {}
            return
        if not cache.kv_forms:
            return
        form = cache.kv_forms[0]
        shape = next(iter(form.kv_groups))
        original = form.kv_groups[shape]
        form.kv_groups[shape] = original.half()
        self.vetoes = {form.form: Reason.LAYOUT_MISMATCH}
        try:
            self.lookups(op)
        finally:
            form.kv_groups[shape], self.vetoes = original, {}

    def step(self, op: tuple[object, ...], warm_check: bool) -> None:
        llm = self.llm
        assert llm is not None
        kind, *_, max_tokens = op
        # copies down to the disk tier are written on threads: let every one finish before the
        # next step and after each offload, so what a step sees never depends on the machine's speed
        self.settle(llm)
        if kind == "lookups":
            self.lookups(op)
        elif kind == "offload":
            llm.offload(self.tier(op))
            self.settle(llm)
        elif kind == "drop":  # offload, lose one deep tier entry, ask for the next turn
            if self.history:
                llm.offload(self.tier(op))
                self.settle(llm)
                ids = self.history[int(op[4]) % len(self.history)]  # type: ignore[call-overload]
                self.drop(ids, int(op[4]), deep=True)  # type: ignore[call-overload]
                self.request("score", [*ids, *rand_tokens(int(op[3]) + 1, int(op[4]))], False)  # type: ignore[call-overload]
        elif kind == "validate":
            self.validate(op)
        elif kind == "prefetch":  # offload, prefetch a next turn (maybe losing a copy in flight)
            llm.offload(self.tier(op))
            self.settle(llm)
            ids = self.prompt(op)
            if self.history and int(op[5]) > 2:  # type: ignore[call-overload]
                ids = [*self.history[int(op[4]) % len(self.history)], *rand_tokens(int(op[3]) + 1, int(op[4]))]  # type: ignore[call-overload]
            self.tally.seen["op:prefetch started"] += llm.prefetch(ids) > 0
            if int(op[4]) % 2:  # type: ignore[call-overload]
                self.drop(ids, int(op[4]), in_flight=True)  # type: ignore[call-overload]
            if llm.cache_config.swap_in_wait and not self.faults().read_during_swap_in:
                llm.cache.settle(wait=True)  # without the hold a copy's timing is not ours to decide
            self.settle(llm)  # the copies down its allocations caused
            self.lookups(op, count=4, ids=ids)
            self.request("score", ids, False)
        elif kind == "restart":
            llm.close()
            llm = self.open()  # the invariants below are the new engine's
        elif kind == "runtime":
            prompts = list(dict.fromkeys(tuple(self.prompt(op, seed_shift=k)) for k in range(3)))
            runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3))
            params = SamplingParams(max_tokens=int(max_tokens), temperature=0.0)  # type: ignore[call-overload]
            try:
                requests = [runtime.add_request(list(p), params) for p in prompts]
            except RequestTooLarge:
                return
            runtime.run()
            for r in requests:
                self.check_request(r.request_id, r.prompt_token_ids)
                self.history.append(r.prompt_token_ids)
        else:
            ids = self.prompt(op)
            if kind == "followup" and self.history:  # the next turn of an earlier conversation
                ids = [*self.history[int(op[4]) % len(self.history)], *ids[-int(op[3]) - 1 :]]  # type: ignore[call-overload]
            self.request(str(kind), ids, warm_check, int(max_tokens))  # type: ignore[call-overload]
        llm.cache.check_invariants()
        if llm.cache.swap is None or not llm.cache.swap.prefetching:  # a prefetch in flight holds its blocks
            assert_no_leases(llm)


    def request(self, kind: str, ids: list[int], warm_check: bool, max_tokens: int = 1) -> None:
        """One ``generate`` (kind ``generate``) or ``score``, compared with the oracle; warm =
        cold checked with ``warm_check``."""
        llm = self.llm
        assert llm is not None
        outputs: list[int] = []
        try:
            if kind == "generate":
                out = llm.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
                rid, outputs = out.request_id, list(out.output_token_ids)
            else:
                score = llm.score(ids)
                rid = score.request_id
                if warm_check and not score.cache.approximate:
                    cold = llm.prefill_logits(ids)[score.resume_tokens :]
                    diff = (score.logits - cold).abs().max().item()
                    assert diff <= TOLERANCE[torch.float32], "warm != cold"
        except RequestTooLarge:
            return
        self.check_request(rid, ids)
        self.history.append([*ids, *outputs[:-1]])  # the last output token is never computed


def kind_of(expected: Expected) -> str:
    plan = expected.plan
    return "resumed" if plan.resume else f"L*=0 target={plan.target}"


def run_scenario(scenario: Scenario, tally: Tally) -> None:
    """Run ``scenario`` and add its comparisons to ``tally``."""
    threads, gate = torch.get_num_threads(), tier_copies.SWAP_GATE_SECONDS
    torch.set_num_threads(1)
    # fault read_during_swap_in: a held copy lands only when the engine lets it, never on a
    # timer (which would make what a lookup sees depend on the machine's speed)
    tier_copies.SWAP_GATE_SECONDS = 3600.0
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(scenario, Path(tmp))
        run.prefixes = [rand_tokens(n, seed) for n, seed in scenario.prefixes]
        llm = run.open()
        try:
            for i, op in enumerate(scenario.ops):
                run.step(op, warm_check=i % 3 == 0)
        finally:
            if run.llm is not None:
                run.llm.close()
            torch.set_num_threads(threads)
            tier_copies.SWAP_GATE_SECONDS = gate
            tally.lookups += run.tally.lookups
            tally.requests += run.tally.requests
            tally.mismatches += run.tally.mismatches
            tally.seen += run.tally.seen
        del llm
