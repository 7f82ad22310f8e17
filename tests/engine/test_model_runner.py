"""The decode model runner: decode batches padded to fixed sizes over buffers whose addresses
never change, recurrent state in decode slots, padding rows on every form's sentinel (case C10),
the same tokens and logits as the per-sequence path, and a decode forward a CUDA graph can
capture (checked on CPU by running it as a capture would)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import engine.model.decode_batch
from engine.llm import LLM
from engine.runtime import Runtime, SchedulerConfig
from engine.runtime.cuda_graphs import HostSyncError, forbid_host_sync, graph_unsafe_reason
from engine.runtime.model_runner import DecodeRunner, supports_static_decode
from engine.sampling import SamplingParams
from kernels.launch import graph_safe, static_launches
from tests.helpers import NO_COMPRESSED, TOLERANCE, assert_no_leases, qwen3_next_dense, tokens

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


def models() -> list[object]:
    return ["qwen3_next-tiny", NO_COMPRESSED, qwen3_next_dense(), "kvscope_hybrid-tiny"]


@pytest.mark.parametrize("model", models(), ids=["qwen3_next-tiny", "hybrid-linear-sliding-full", "qwen3_next-dense", "kvscope_hybrid-tiny"])
def test_static_decode_matches_the_per_sequence_path(model: object) -> None:
    """Besides MoE models and DeepSeek-V4 layers (per row inside the batch), every step runs as a
    CUDA graph capture records it (no host reads, no value-shaped ops, the launchers' value checks
    skipped): the decode forward is capturable."""
    prompts = [tokens(40 + 9 * i, 60 + i) for i in range(5)]
    want = [o.output_token_ids for o in LLM(model, device="cpu").generate(prompts, PARAMS)]
    llm = LLM(model, device="cpu", check_invariants=True)
    capturable = graph_unsafe_reason(llm.model) is None
    assert capturable == (model not in ("qwen3_next-tiny", "kvscope_hybrid-tiny"))
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8), check_graph_safe=capturable)
    assert runtime.decode_runner is not None and not runtime.decode_runner.graphs  # no capture off CUDA
    added = [runtime.add_request(p, PARAMS, keep_logits=True) for p in prompts]
    runner = runtime.decode_runner
    addresses = [t.data_ptr() for t in runner.buffers()]
    sizes = set()
    while runtime.has_unfinished():
        runtime.step()
        sizes.add(sum(1 for r in runtime.running if r.decode_slot is not None))
        assert [t.data_ptr() for t in runner.buffers()] == addresses  # never reallocated
    assert len(sizes) > 2  # batches of several sizes went through the same buffers
    assert [r.output_token_ids for r in added] == want
    for r in added[::2]:
        for i, row in enumerate(r.sampled_logits):
            cold = llm.prefill_logits(r.prompt_token_ids + r.output_token_ids[:i])[-1]
            assert (row - cold).abs().max().item() <= TOLERANCE[torch.float32]
    assert runner.free_slots == 8  # every slot back
    assert_no_leases(llm)


def test_padding_rows_never_touch_a_live_request_c10() -> None:
    """Case C10: one live request decodes in the first allocatable slot (1) inside a batch padded
    to 4; the three padding rows use the sentinel slot 0 and each form's sentinel page, so the
    live request's state and window are untouched: its tokens and logits equal an unpadded run."""
    prompt = tokens(70, 5)
    want = LLM("qwen3_next-tiny", device="cpu").generate([prompt], PARAMS)[0].output_token_ids
    llm = LLM("qwen3_next-tiny", device="cpu", check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_seqs=4), decode_batch_sizes=(4,))
    runner = runtime.decode_runner
    assert runner is not None and runner.sizes == (4,)
    live = runtime.add_request(prompt, PARAMS, keep_logits=True)
    padded_steps = 0
    while runtime.has_unfinished():
        runtime.step()
        if live.decode_slot is not None:
            assert live.decode_slot == 1  # the first slot a request can own
            assert runner.slot_ids[:4].tolist() == [1, 0, 0, 0]
            for i in range(len(runner.forms)):
                assert runner.write_pages[i][1:4].tolist() == [0, 0, 0] and runner.seq_lens[i][1:4].tolist() == [0, 0, 0]
                assert not runner.block_tables[i][1:4].any()
            padded_steps += 1
    assert padded_steps >= 6
    assert live.output_token_ids == want
    for i, row in enumerate(live.sampled_logits):
        cold = llm.prefill_logits(prompt + live.output_token_ids[:i])[-1]
        assert (row - cold).abs().max().item() <= TOLERANCE[torch.float32]


def test_the_sentinel_slot_is_never_handed_out_and_slots_are_checked() -> None:
    llm = LLM("qwen3_next-tiny", device="cpu")
    runner = DecodeRunner(llm, max_num_seqs=3, max_model_len=256)
    seqs = [llm.cache.start(llm.cache.admit(llm.cache.block_hashes(tokens(20, i)), 20, None).plan, tokens(20, i), llm.cache.block_hashes(tokens(20, i))) for i in range(3)]
    slots = [runner.acquire(s) for s in seqs]
    assert sorted(slots) == [1, 2, 3] and runner.free_slots == 0
    with pytest.raises(RuntimeError, match="no free decode slot"):
        runner.acquire(seqs[0])
    with pytest.raises(RuntimeError, match="not a releasable slot"):
        runner.release(0)
    runner.release(slots[0])
    with pytest.raises(RuntimeError, match="released twice"):
        runner.release(slots[0])
    for s in seqs:
        s.finish()


def test_models_without_the_batched_path_fall_back() -> None:
    llm = LLM("deepseek_v4-tiny", device="cpu")
    assert not supports_static_decode(llm.model) and Runtime(llm).decode_runner is None
    with pytest.raises(ValueError, match="no batched decode path"):
        DecodeRunner(llm, 4, 256)
    with pytest.raises(ValueError, match="max_model_len"):
        Runtime(LLM("qwen3_next-tiny", device="cpu"), SchedulerConfig(max_model_len=64)).add_request(tokens(60, 1), SamplingParams(max_tokens=10))


def test_the_capture_check_catches_what_a_graph_cannot_hold() -> None:
    x = torch.arange(6.0)
    ids = torch.tensor([0, 2, 4])
    forbidden = {
        "item": lambda: x[0].item(),
        "__int__": lambda: int(x[1]),
        "__bool__": lambda: bool((x > 2).any()),
        "tolist": lambda: x.tolist(),
        "nonzero": lambda: torch.nonzero(x),
        "__getitem__": lambda: x[x > 2],
        "unique": lambda: torch.unique(ids),
        "tensor": lambda: torch.tensor([1.0, 2.0]),
        "repeat_interleave": lambda: torch.repeat_interleave(x, torch.ones(6, dtype=torch.long)),
        "where": lambda: torch.where(x > 2),
        "equal": lambda: torch.equal(x, x),
        "is_nonzero": lambda: x[0].is_nonzero(),
        "Python list": lambda: x[[0, 2]],
    }
    for name, op in forbidden.items():
        with forbid_host_sync(), pytest.raises(HostSyncError, match=name):
            op()
    with forbid_host_sync():  # what a capture may hold: fixed shapes, indices on the device
        y = x.clone()
        y[ids] = x[ids] * 2
        y.index_put_((ids,), torch.zeros(3))
        torch.arange(4) + x[:4].repeat_interleave(1)
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)
        y[y > 4] = 0.0  # masked_fill_
        torch.as_tensor(y)
        torch.where(x > 2, x, y)
    assert y.tolist() == [0.0, 1.0, 0.0, 3.0, 0.0, 0.0]


def test_an_uncapturable_decode_step_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: the MoE model's dispatch, and the torch attention reading the
    longest row's length on the host (what it does outside a capture), both fail it."""
    params = SamplingParams(max_tokens=3, temperature=0.0)
    runtime = Runtime(LLM("qwen3_next-tiny", device="cpu"), SchedulerConfig(max_num_seqs=2), check_graph_safe=True)
    runtime.add_request(tokens(30, 1), params)
    with pytest.raises(HostSyncError, match="bincount"):  # the expert grouping's sizes, read on the host
        runtime.run()
    monkeypatch.setattr(engine.model.decode_batch, "graph_safe", lambda *tensors: False)
    runtime = Runtime(LLM(NO_COMPRESSED, device="cpu"), SchedulerConfig(max_num_seqs=2), check_graph_safe=True)
    runtime.add_request(tokens(30, 1), params)
    with pytest.raises(HostSyncError, match="__int__"):
        runtime.run()


def test_graph_options_are_checked_and_launches_are_static_only_when_asked() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DecodeRunner(LLM(NO_COMPRESSED, device="cpu"), 4, 256, cuda_graphs=True)
    with pytest.raises(ValueError, match="sparse MoE"):
        DecodeRunner(LLM("qwen3_next-tiny", device="cpu"), 4, 256, cuda_graphs=True)
    runner = DecodeRunner(LLM(NO_COMPRESSED, device="cpu"), 4, 256)
    assert runner.graphs == {} and not runner.check_graph_safe
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        runner.capture()
    t = torch.zeros(2)
    assert not graph_safe(t)
    with static_launches():
        with static_launches():
            assert graph_safe(t)
        assert graph_safe(t)
    assert not graph_safe(t)


def test_block_tables_are_checked_on_the_host_before_a_step() -> None:
    """A replayed graph runs no launcher checks, so the runner checks pages itself."""
    llm = LLM(NO_COMPRESSED, device="cpu")
    runner = DecodeRunner(llm, 2, 256)
    unit = runner.unit
    with pytest.raises(RuntimeError, match="outside the pool"):
        runner._check_pages([[[0, runner.num_blocks[0]]] for _ in runner.forms], [unit])
    with pytest.raises(RuntimeError, match="block table of 1 pages for position"):
        runner._check_pages([[[1]] for _ in runner.forms], [unit])
    runner._check_pages([[[1, 2]] for _ in runner.forms], [unit])


class RecordedGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU: "capturing" keeps the forward to rerun on
    the same buffers, and each replay reruns it into the same output tensor."""

    def __init__(self, runner: DecodeRunner, size: int) -> None:
        self.runner, self.size, self.replays = runner, size, 0
        runner._graph_logits[size] = runner._forward(size, static=True)

    def replay(self) -> None:
        self.replays += 1
        self.runner._graph_logits[self.size].copy_(self.runner._forward(self.size, static=True))


def test_a_replayed_step_reads_the_filled_buffers_and_returns_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay branch of ``run``: the graph of the padded size replays over the buffers the
    step filled, and the logits handed back are a copy the next replay cannot overwrite."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    prompts = [tokens(40 + 9 * i, 60 + i) for i in range(3)]
    params = [PARAMS, PARAMS, SamplingParams(max_tokens=12, temperature=0.0)]  # the last decodes alone at the end
    cold = LLM(NO_COMPRESSED, device="cpu")
    want = [cold.generate(p, sp)[0] for p, sp in zip(prompts, params, strict=True)]
    llm = LLM(NO_COMPRESSED, device="cpu", check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_seqs=4), decode_batch_sizes=(2, 4))
    runner = runtime.decode_runner
    assert runner is not None
    graphs = {size: RecordedGraph(runner, size) for size in runner.sizes}
    runner.graphs.update(graphs)  # type: ignore[arg-type]
    added = [runtime.add_request(p, sp, keep_logits=True) for p, sp in zip(prompts, params, strict=True)]
    runtime.run()
    assert all(g.replays for g in graphs.values())  # batches of 3 and of 1 live rows (padded to 4, 2)
    assert [r.output_token_ids for r in added] == [o.output_token_ids for o in want]
    outputs = [row for r in added for row in r.sampled_logits]
    assert all(row.data_ptr() != runner._graph_logits[s].data_ptr() for row in outputs for s in runner.sizes)
    for r in added:
        for i, row in enumerate(r.sampled_logits):
            cold = llm.prefill_logits(r.prompt_token_ids + r.output_token_ids[:i])[-1]
            assert (row - cold).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (on CPU the capture check above stands in)")
def test_cuda_graphs_replay_the_eager_decode_step() -> None:
    """On CUDA the runner captures one graph per padded size; replaying them gives the eager
    runner's tokens and logits, over the same buffer addresses; the MoE model runs eagerly on the
    torch backend and is captured through the kernels (``fused_moe``)."""
    prompts = [tokens(40 + 9 * i, 60 + i) for i in range(5)]
    results = {}
    for graphs in (False, True):
        llm = LLM(qwen3_next_dense(), device="cuda", check_invariants=True)
        runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8), cuda_graphs=graphs)
        runner = runtime.decode_runner
        assert runner is not None and bool(runner.graphs) == graphs
        if graphs:
            assert sorted(runner.graphs) == list(runner.sizes)
        addresses = [t.data_ptr() for t in runner.buffers()]
        added = [runtime.add_request(p, PARAMS, keep_logits=True) for p in prompts]
        runtime.run()
        assert [t.data_ptr() for t in runner.buffers()] == addresses
        results[graphs] = added
    for eager, replayed in zip(results[False], results[True], strict=True):
        assert eager.output_token_ids == replayed.output_token_ids
        for a, b in zip(eager.sampled_logits, replayed.sampled_logits, strict=True):
            assert (a - b).abs().max().item() <= TOLERANCE[torch.float32]
    moe = LLM("qwen3_next-tiny", device="cuda", kernel_backend="torch")
    assert Runtime(moe).decode_runner.graphs == {}  # type: ignore[union-attr]  # torch MoE: eager
    moe.close()
    fused = LLM("qwen3_next-tiny", device="cuda")  # the kernels: fused_moe is capturable
    assert Runtime(fused).decode_runner.graphs  # type: ignore[union-attr]
    fused.close()
