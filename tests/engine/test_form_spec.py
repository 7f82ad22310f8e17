"""The cache core's parts: one spec per form computed from the layout alone (it matches every
allocated pool, and the memory plan sizes pools from it without building a throw-away cache),
named pool rows, a replaced config reaching every part, and a request's sequence that runs on
the pieces it is given (no PrefixCache)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, CacheConfig
from engine.cache import form_set as form_set_module
from engine.cache.checkpoint_writer import CheckpointWriter
from engine.cache.form_set import FormSet
from engine.cache.form_spec import PoolKind, layout_pools
from engine.cache.prefix_cache import PrefixCache
from engine.cache.sequence import PagedSequence
from engine.cache.what_if import planned_config
from engine.events import Form
from tests.helpers import tokens

U = 16
CFG = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64)
MODELS = ["deepseek_v4-tiny", "kvscope_hybrid-tiny", "qwen3_next-tiny"]
CPU = torch.device("cpu")


@pytest.mark.parametrize("model", MODELS)
def test_pool_specs_match_the_allocated_pools(model: str) -> None:
    """The specs come from the layout alone; each names its pool and has the bytes per block
    the allocated tensors take (read off the tensors, not the forms' own arithmetic); its kind
    names the CacheConfig count that sized the pool."""
    layout = LLM(model, cache=CFG).layout
    specs = layout_pools(layout, U, torch.float32)
    cache = PrefixCache(layout, CFG, model, CPU, torch.float32)
    assert list(specs) == [f.form for f in cache.forms]
    for f in cache.forms:
        pools = specs[f.form]
        assert [p.name for p in pools] == [pool.name for pool in f.pools]
        assert sum(p.bytes_per_block for p in pools) == sum(t.tensor[0].numel() * t.tensor.element_size() for t in f.stored_tensors())
        for p, pool in zip(pools, f.pools, strict=True):
            assert p.form is f.form and pool.num_blocks == getattr(CFG, p.kind.config_field)
    entries = cache.pool_entries()
    assert [e.kind for e in entries] == sorted((e.kind for e in entries), key=list(PoolKind).index)
    assert {(e.pool.name, e.bytes_per_block, e.page_tokens) for e in entries} == {
        (p.name, p.bytes_per_block, p.page_tokens) for ps in specs.values() for p in ps
    }
    form, pool, kind, nbytes, page = entries[0]  # still a 5-tuple for callers that unpack it
    assert (form, pool, kind, nbytes, page) == (entries[0].form, entries[0].pool, entries[0].kind, entries[0].bytes_per_block, entries[0].page_tokens)


def test_specs_say_how_each_form_recovers() -> None:
    specs = LLM("kvscope_hybrid-tiny", cache=CFG).cache.form_specs()
    assert [f for f, s in specs.items() if s.replayable] == [Form.LINEAR_STATE]
    assert [f for f, s in specs.items() if s.checkpointed] == [Form.UNCOMPRESSED_TAIL, Form.INDEXER_STATE, Form.LINEAR_STATE]
    assert [p.kind for p in specs[Form.INDEXER_STATE].pools] == [PoolKind.ENTRY_PAGE, PoolKind.BOUNDARY_SLOT]
    assert [p.page_tokens for p in specs[Form.COMPRESSED_KV].pools] == [16, 16]  # ratios 4 and 16 tile U


@pytest.mark.parametrize("model", ["kvscope_hybrid-tiny", "deepseek_v4-tiny"])
def test_planned_sizes_the_pools_without_a_throw_away_cache(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = LLM(model, cache=CFG).layout
    budget = 4 * 2**20
    config = dataclasses.replace(CFG, memory_bytes=budget)
    built = []
    init = form_set_module.FormSet.__init__

    def counting(self: FormSet, *args: object, **kwargs: object) -> None:
        built.append(args[1])
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(form_set_module.FormSet, "__init__", counting)
    cache = PrefixCache.planned(layout, config, model, CPU, torch.float32)
    sized, capacity = planned_config(layout, config, torch.float32)
    assert built == [sized] and cache.config == sized and cache.budget == (budget, capacity)
    plan = cache.memory_plan()
    assert plan.capacity_tokens == capacity and plan.total_bytes <= budget
    for p in plan.pools:
        assert p.blocks + 1 == getattr(sized, p.kind.config_field)


def test_a_replaced_config_reaches_every_part() -> None:
    """``cache.config = ...`` (as kvscope's TTFT bench does for the replay fraction) changes
    the policy every part reads from the next call on."""
    cache = LLM("kvscope_hybrid-tiny", cache=dataclasses.replace(CFG, host_tier_bytes=2**20)).cache
    new = dataclasses.replace(cache.config, replay_fraction=0.5)
    cache.config = new
    assert cache.config is new and cache.swap is not None
    assert all(part.config is new for part in (cache.form_set, cache.swap, cache.writer, cache.planner, cache.accounting))


def test_a_sequence_runs_on_its_pieces() -> None:
    """A sequence built from a form set and a checkpoint writer alone allocates, publishes and
    gives back its pages; the prefix it published stays cached."""
    layout = LLM("qwen3_next-tiny", cache=CFG).layout
    fs = FormSet(layout, CFG, "qwen3_next-tiny", CPU, torch.float32)
    ids = tokens(40, 1)
    hashes = fs.block_hashes(ids)
    running: set[PagedSequence] = set()
    seq = PagedSequence(fs, CheckpointWriter(fs, CFG), running, ids, hashes, 0, frozenset())
    running.add(seq)
    seq.begin_chunk(40)
    seq.commit(40, take_checkpoint=False)
    (full,) = fs.kv_forms
    assert fs.index.hit_blocks(hashes) == 2 and full.pool.num_leased == 3  # two full pages and the one being filled
    seq.finish()
    assert not running and full.pool.num_leased == 0
    assert fs.index.hit_blocks(hashes) == 2 and full.pool.num_cached == 2
