"""The decode model runner: persistent input buffers, block tables and decode slots, decode
batches padded to fixed sizes, and one CUDA graph per padded size (vLLM's ``GPUModelRunner``
persistent batch and ``CUDAGraphRunner``, SGLang's ``CudaGraphRunner``).

Buffers are allocated once, for the largest batch size, and never reallocated: each step fills a
prefix ``[:B_pad]`` of them in place, so every tensor the forward reads keeps its address from
step to step. On CUDA the host writes the step's inputs into pinned mirrors and uploads them
without blocking (``copy_(non_blocking=True)``, then an event the next step waits on before
reusing the mirrors). On CUDA with the kernels (unless ``cuda_graphs=False``), for a model whose
decode step is capturable, the runner captures the forward once per padded size at start, on buffers filled with padding, and each step only fills
the buffers and replays the graph of its size. On CPU the same static-buffer path runs eagerly;
with ``check_graph_safe`` it runs exactly what a capture would record (the kernels' launchers
without host reads, :mod:`kernels.launch`) under :class:`~engine.runtime.cuda_graphs.forbid_host_sync`,
so a CPU test proves the forward is capturable. Because a replay never runs the launchers'
value checks, :meth:`DecodeRunner.run` checks the same values (sequence lengths against the block
tables' width, block ids against the pools) on the host before every step.

Padding (case C10): rows ``[B, B_pad)`` get token 0 at position 0, ``seq_lens`` 0, every KV
form's sentinel page (block 0) as their block table and write page, and decode slot 0, the
sentinel slot no request can own. Whatever they compute and write lands there; a capture runs on
an all-padding batch, so it writes only there too.

Decode slots: a request's working recurrent state (conv and delta-rule state of every linear
layer) moves into a static slot ``[S, ...]`` when it starts decoding; the batched step updates the
slots in place, and the request's :class:`~engine.model.state.LinearLayerState` entries become
views of its slot, so its state stays readable where the cache looks for it.
"""

from __future__ import annotations

import logging
import math
from contextlib import ExitStack

import torch
from torch import Tensor, nn

from engine.cache.sequence import PagedSequence
from engine.llm import LLM
from engine.model.decode_batch import DecodeBatch
from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.hybrid import HybridForCausalLM
from engine.model.state import LinearLayerState
from engine.runtime.cuda_graphs import forbid_host_sync, graph_unsafe_reason
from kernels.launch import static_launches

log = logging.getLogger(__name__)

DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Padded decode batch sizes (the sizes graphs are captured at), up to ``max_num_seqs``."""


def supports_static_decode(model: nn.Module) -> bool:
    """Whether ``model`` decodes through the runner: every ``kvscope_hybrid`` and Qwen3-Next
    model (a hybrid's DeepSeek-V4 layers run per row inside the batch,
    :meth:`~engine.model.decode_batch.DecodeBatch.per_row`), not yet the ``deepseek_v4`` family
    itself (its decoder layers have no batch entry)."""
    return isinstance(model, HybridForCausalLM) or not any(isinstance(m, DeepseekV4Attention) for m in model.modules())


class DecodeRunner:
    """Runs decode steps of up to ``max_num_seqs`` sequences over static buffers (module
    docstring).

    Args:
        llm: the engine whose model and cache pools the buffers index.
        max_num_seqs: the most rows a step holds (and decode slots, besides the sentinel).
        max_model_len: the longest sequence, tokens; sets the block tables' width.
        batch_sizes: the padded sizes to use (default: :data:`DECODE_BATCH_SIZES` up to
            ``max_num_seqs``, which is always one of them).
        cuda_graphs: capture one graph per padded size and replay it (vLLM's ``enforce_eager``
            is ``cuda_graphs=False``). None: on CUDA with the Triton backend when the model's
            decode forward is capturable (:func:`~engine.runtime.cuda_graphs.graph_unsafe_reason`);
            otherwise, or if the capture fails, it decodes eagerly, logged. True off CUDA or on
            an uncapturable model raises; a failed capture then raises too.
        check_graph_safe: run every eager step as a capture would, under
            :class:`~engine.runtime.cuda_graphs.forbid_host_sync` (tests; slow).

    Raises:
        ValueError: a model without the batched decode path, non-positive limits, or
            ``cuda_graphs=True`` where graphs cannot be captured.
        RuntimeError: with ``cuda_graphs=True``, a capture that fails (see :meth:`capture`).
    """

    def __init__(
        self, llm: LLM, max_num_seqs: int, max_model_len: int, batch_sizes: tuple[int, ...] | None = None,
        *, cuda_graphs: bool | None = None, check_graph_safe: bool = False,
    ) -> None:  # fmt: skip
        if not supports_static_decode(llm.model):
            raise ValueError(f"{llm.model_name}: the deepseek_v4 family has no batched decode path yet")
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs and max_model_len must be positive")
        sizes = batch_sizes or tuple(s for s in DECODE_BATCH_SIZES if s < max_num_seqs)
        self.sizes = tuple(sorted({*sizes, max_num_seqs} if batch_sizes is None else set(sizes)))
        if self.sizes[-1] < max_num_seqs:
            raise ValueError(f"batch sizes {self.sizes} do not reach max_num_seqs = {max_num_seqs}")
        self.llm = llm
        cache = llm.cache
        device = cache.device
        rows = self.sizes[-1]
        self.unit = cache.unit_tokens
        self.max_pages = math.ceil(max_model_len / self.unit)
        self.forms = list(cache.kv_forms)
        self.kv_of_layer = {layer: (kv, slot, i) for i, form in enumerate(self.forms) for layer, (kv, slot) in form.layer_slot.items()}
        self.num_blocks = [min((kv.shape[0] for kv, _ in form.layer_slot.values()), default=0) for form in self.forms]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.block_tables = [torch.zeros((rows, self.max_pages), dtype=torch.int32, device=device) for _ in self.forms]
        self.seq_lens = [torch.zeros(rows, dtype=torch.int32, device=device) for _ in self.forms]
        self.write_pages = [torch.zeros(rows, dtype=torch.long, device=device) for _ in self.forms]
        self.write_offsets = [torch.zeros(rows, dtype=torch.long, device=device) for _ in self.forms]
        num_slots = self.num_slots = max_num_seqs + 1  # slot 0: the sentinel padding rows use
        shapes = llm.layout.linear_state_shapes
        self.conv = {layer: torch.zeros((num_slots, *conv), dtype=torch.float32, device=device) for layer, (conv, _) in shapes.items()}
        self.recurrent = {layer: torch.zeros((num_slots, *rec), dtype=torch.float32, device=device) for layer, (_, rec) in shapes.items()}
        self._free = list(range(num_slots - 1, 0, -1))
        self._batches = {size: self._batch(size) for size in self.sizes}
        self._inputs: dict[str, Tensor] = {"input_ids": self.input_ids, "positions": self.positions, "slot_ids": self.slot_ids}
        """The buffers each step fills, by name."""
        for i in range(len(self.forms)):
            self._inputs |= {
                f"block_tables.{i}": self.block_tables[i], f"seq_lens.{i}": self.seq_lens[i],
                f"write_pages.{i}": self.write_pages[i], f"write_offsets.{i}": self.write_offsets[i],
            }  # fmt: skip
        self._cuda = device.type == "cuda"
        # on CUDA the host writes each step's inputs into pinned mirrors, uploaded without blocking
        self._host = {name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=True) for name, t in self._inputs.items()} if self._cuda else self._inputs
        self._uploaded: torch.cuda.Event | None = None
        self.check_graph_safe = check_graph_safe
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        """The captured graph of each padded size (empty when running eagerly)."""
        self._graph_logits: dict[int, Tensor] = {}
        unsafe = graph_unsafe_reason(llm.model)
        if cuda_graphs and (device.type != "cuda" or unsafe):
            raise ValueError(f"cuda_graphs=True needs a CUDA device and a capturable model; {llm.model_name} on {device.type}" + (f": {unsafe}" if unsafe else ""))
        if cuda_graphs:
            self.capture()
        elif cuda_graphs is None and device.type == "cuda":
            if llm.kernel_backend != "triton":
                unsafe = unsafe or "the torch backend's graph attends over every page of max_model_len (the kernels read only each row's)"
            if unsafe:
                log.warning("%s: decode runs without CUDA graphs: %s", llm.model_name, unsafe)
            else:
                try:
                    self.capture()
                except Exception:  # auto mode: an uncapturable forward decodes eagerly
                    log.exception("%s: capturing the decode CUDA graphs failed; decoding eagerly (--enforce-eager avoids trying)", llm.model_name)
                    self.graphs.clear()
                    self._graph_logits.clear()
                    torch.cuda.synchronize(device)

    def buffers(self) -> list[Tensor]:
        """Every persistent tensor the decode forward reads or writes (besides the pools)."""
        return [*self._inputs.values(), *self.conv.values(), *self.recurrent.values()]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self, seq: PagedSequence) -> int:
        """Give ``seq`` a decode slot: its working recurrent state is copied in, and its
        ``linear_states`` become views of the slot.

        Raises:
            RuntimeError: every slot is taken (more decoding sequences than ``max_num_seqs``).
        """
        if not self._free:
            raise RuntimeError("no free decode slot: more sequences decoding than max_num_seqs")
        slot = self._free.pop()
        for layer, state in seq.linear_states.items():
            self.conv[layer][slot].copy_(state.conv)
            self.recurrent[layer][slot].copy_(state.recurrent)
            seq.linear_states[layer] = LinearLayerState(self.conv[layer][slot], self.recurrent[layer][slot])
        return slot

    def release(self, slot: int) -> None:
        """Return a request's slot (its state there is left as is; the next owner overwrites it).

        Raises:
            RuntimeError: the sentinel, an unknown slot, or one already free.
        """
        if not 0 < slot < self.num_slots:
            raise RuntimeError(f"decode slot {slot} is not a releasable slot")
        if slot in self._free:
            raise RuntimeError(f"decode slot {slot} released twice")
        self._free.append(slot)

    def padded_size(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    @torch.no_grad()
    def run(self, rows: list[tuple[PagedSequence, int]]) -> Tensor:
        """One decode step for ``rows`` (sequence, decode slot), each with its one-token chunk
        begun (``begin_chunk``) and not yet committed. Returns logits ``[len(rows), vocab]``.

        Raises:
            ValueError: more rows than the largest batch size, or a sequence longer than
                ``max_model_len``.
            RuntimeError: a row whose chunk was not begun, or a block table that does not cover
                its position or names a page outside its pool (:meth:`_check_pages`).
        """
        b = len(rows)
        if not 0 < b <= self.sizes[-1]:
            raise ValueError(f"{b} rows for decode batches of at most {self.sizes[-1]}")
        b_pad = self.padded_size(b)
        ids, positions, slots = [], [], []
        tables: list[list[list[int]]] = [[] for _ in self.forms]
        for seq, slot in rows:
            pos = seq.num_computed_tokens
            if pos + 1 > self.max_pages * self.unit:
                raise ValueError(f"a sequence of {pos + 1} tokens exceeds max_model_len = {self.max_pages * self.unit}")
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(slot)
            for i, form in enumerate(self.forms):
                tables[i].append(seq.tables[form])
        self._check_pages(tables, positions)
        pad = b_pad - b
        host = self._staging()
        host["input_ids"][:b_pad] = torch.tensor(ids + [0] * pad)
        host["positions"][:b_pad] = torch.tensor(positions + [0] * pad)
        host["slot_ids"][:b_pad] = torch.tensor(slots + [0] * pad)
        for i in range(len(self.forms)):
            table = host[f"block_tables.{i}"]
            table[:b_pad].zero_()
            for r, row in enumerate(tables[i]):
                table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
            host[f"seq_lens.{i}"][:b_pad] = torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32)
            host[f"write_pages.{i}"][:b_pad] = torch.tensor([tables[i][r][p // self.unit] for r, p in enumerate(positions)] + [0] * pad)
            host[f"write_offsets.{i}"][:b_pad] = torch.tensor([p % self.unit for p in positions] + [0] * pad)
        self._upload(b_pad)
        live = []
        for seq, _ in rows:
            if seq.chunk_positions is None:
                raise RuntimeError("a decode row whose chunk was not begun (begin_chunk)")
            live.append((seq, seq.chunk_positions))
        batch = self._batches[b_pad]
        batch.sequences = tuple(live)
        try:
            graph = self.graphs.get(b_pad)
            if graph is not None:
                with torch.cuda.device(self.input_ids.device):
                    graph.replay()
                return self._graph_logits[b_pad][:b].clone()  # the next replay overwrites the output
            return self._forward(b_pad, static=self.check_graph_safe)[:b]
        finally:
            batch.sequences = ()  # no reference to finished sequences between steps

    def _staging(self) -> dict[str, Tensor]:
        """Where the host writes a step's inputs: on CUDA the pinned mirrors (once the previous
        step's uploads from them are done), elsewhere the buffers themselves."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the mirrors are free again
        return self._host

    def _upload(self, rows: int) -> None:
        """Copy the first ``rows`` rows of every pinned mirror to its buffer without blocking the
        host (one event marks the end); nothing to do off CUDA."""
        if not self._cuda:
            return
        for name, buffer in self._inputs.items():
            buffer[:rows].copy_(self._host[name][:rows], non_blocking=True)
        if self._uploaded is None:
            self._uploaded = torch.cuda.Event(blocking=True)  # the host sleeps, not spins, waiting on it
        self._uploaded.record(torch.cuda.current_stream(self.input_ids.device))

    def _check_pages(self, tables: list[list[list[int]]], positions: list[int]) -> None:
        """What the kernels' launchers check on device values, checked on the host (a replay runs
        no launcher): each row's pages cover its position and fit the block table, and every
        block id is a page of its pool.

        Raises:
            RuntimeError: a table that breaks either (the cache handed out a bad block table).
        """
        for i, form_tables in enumerate(tables):
            for row, pos in zip(form_tables, positions, strict=True):
                if not pos // self.unit < len(row) <= self.max_pages:
                    raise RuntimeError(f"a block table of {len(row)} pages for position {pos} (pages of {self.unit}, at most {self.max_pages})")
                if row and not 0 <= min(row) <= max(row) < self.num_blocks[i]:
                    raise RuntimeError(f"block ids {min(row)}..{max(row)} outside the pool's 0..{self.num_blocks[i] - 1}")

    def _batch(self, size: int) -> DecodeBatch:
        """The batch of ``size`` rows over the buffers' prefixes (built once per size)."""
        return DecodeBatch(
            size=size,
            kv_of_layer=self.kv_of_layer,
            block_tables=[t[:size] for t in self.block_tables],
            seq_lens=[t[:size] for t in self.seq_lens],
            write_pages=[t[:size] for t in self.write_pages],
            write_offsets=[t[:size] for t in self.write_offsets],
            slot_ids=self.slot_ids[:size],
            conv=self.conv,
            recurrent=self.recurrent,
        )

    def _forward(self, size: int, *, static: bool) -> Tensor:
        """The model on the first ``size`` rows of the buffers → logits ``[size, vocab]``; with
        ``static``, exactly as a capture records it (no host reads, checked)."""
        with ExitStack() as stack:
            if static:
                stack.enter_context(static_launches())
                stack.enter_context(forbid_host_sync())
            return self.llm.model(self.input_ids[:size], self.positions[:size], self._batches[size])

    def _fill_padding(self, size: int) -> None:
        """Every one of the first ``size`` rows a padding row (token 0, position 0, sentinel page
        and slot, length 0)."""
        for t in self._inputs.values():
            t[:size].zero_()

    @torch.no_grad()
    def capture(self) -> None:
        """Capture one CUDA graph per padded size, largest first, sharing one memory pool: each
        on an all-padding batch after two warm-up runs on a side stream (Triton compiles and
        cuBLAS initialises outside the capture), as ``torch.cuda.graphs`` recommends.

        Raises:
            RuntimeError: not on CUDA; :class:`~engine.runtime.cuda_graphs.HostSyncError` or a
                CUDA capture error when the forward is not capturable.
        """
        device = self.input_ids.device
        if not self._cuda:
            raise RuntimeError("CUDA graphs need a CUDA device")
        with torch.cuda.device(device):  # streams and the capture on the model's GPU, not cuda:0
            pool = torch.cuda.graph_pool_handle()
            capture_stream = torch.cuda.Stream(device)
            for size in sorted(self.sizes, reverse=True):
                self._fill_padding(size)
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._forward(size, static=True)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                    self._graph_logits[size] = self._forward(size, static=True)
                self.graphs[size] = graph
            torch.cuda.synchronize(device)
        log.info("captured CUDA graphs for decode batch sizes %s", ", ".join(map(str, self.sizes)))
