"""What a layer reads and writes besides its weights: the per-sequence state protocol.

The model code is the same for the reference path (``LLM.prefill_logits``: a dense state built
from nothing) and for the cached path (a paged state whose KV lives in the cache pools and whose
recurrent state was restored from a checkpoint). Layers only see this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch import Tensor


class AttentionKV(NamedTuple):
    """Keys and values a query chunk may attend to, with their absolute positions.

    keys, values: ``[S, H_kv, D]``; positions: ``[S]`` (int64), ascending.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor


class AttentionPages(NamedTuple):
    """One sequence's keys and values of one attention layer as the paged kernels read them.

    k_cache, v_cache: ``[num_blocks, P, H_kv, D]`` (any strides; a layer's slice of a pool).
    block_table: ``[1, num_pages]`` int32, page ids in token order (pages before a sliding
        window may be the sentinel page: the kernels never read them).
    num_tokens: L, tokens stored, the chunk's included (its last position + 1).
    """

    k_cache: Tensor
    v_cache: Tensor
    block_table: Tensor
    num_tokens: int


PAGE_TOKENS = 16
"""Page size :class:`DenseState` lays its keys out in for the paged kernels."""


def as_pages(keys: Tensor, values: Tensor) -> AttentionPages:
    """Contiguous ``keys / values [S, H_kv, D]`` (positions 0 … S−1) viewed as pages of
    :data:`PAGE_TOKENS` rows (the last one zero-padded) with an identity block table."""
    s = keys.shape[0]
    pad = (-s) % PAGE_TOKENS
    if pad:
        keys = torch.cat((keys, keys.new_zeros((pad, *keys.shape[1:]))))
        values = torch.cat((values, values.new_zeros((pad, *values.shape[1:]))))
    n = keys.shape[0] // PAGE_TOKENS
    table = torch.arange(n, dtype=torch.int32, device=keys.device)[None]
    return AttentionPages(keys.view(n, PAGE_TOKENS, *keys.shape[1:]), values.view(n, PAGE_TOKENS, *values.shape[1:]), table, s)


@dataclass(slots=True)
class LinearLayerState:
    """State of one Gated DeltaNet layer for one sequence.

    conv: ``[C_conv, K - 1]`` — the last K−1 inputs of the short causal conv, oldest first.
    recurrent: ``[H_v, D_k, D_v]`` — the delta-rule state matrix per value head (float32).
    """

    conv: Tensor
    recurrent: Tensor

    def clone(self) -> LinearLayerState:
        """An independent copy (no storage shared with this state)."""
        return LinearLayerState(self.conv.clone(), self.recurrent.clone())


@dataclass(frozen=True, slots=True, kw_only=True)
class CompressorSpec:
    """Geometry of one compressor of a DeepSeek-V4 compressed layer (the main KV compressor or
    the CSA indexer's own compressor).

    ratio: r, source tokens pooled into one compressed entry (compression ratio).
    head_dim: D, width of one compressed entry.
    overlapping: True for CSA (ratio-4 style): each source row is ``2·D`` wide; entry w pools
        the second halves of group w's rows with the first halves of group w − 1's rows.

    Raises:
        ValueError: a non-positive ratio or head_dim.
    """

    ratio: int
    head_dim: int
    overlapping: bool

    def __post_init__(self) -> None:
        if self.ratio <= 0 or self.head_dim <= 0:
            raise ValueError(f"compressor ratio = {self.ratio} and head_dim = {self.head_dim} must be positive")

    @property
    def row_width(self) -> int:
        """Width F of one pending (projected) source row: ``2·D`` when overlapping, else D."""
        return 2 * self.head_dim if self.overlapping else self.head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class CompressedLayerSpec:
    """What a ``compressed_sparse_attention`` / ``heavily_compressed_attention`` layer keeps.

    window: W, the sliding window of the layer's local branch (a query sees its last W rows).
    head_dim: D of the shared key/value (K = V) rows of the window.
    compressor: the main KV compressor.
    indexer: the indexer's compressor (CSA), None for HCA.
    dtype: element type of every tensor of the state.
    """

    window: int
    head_dim: int
    compressor: CompressorSpec
    indexer: CompressorSpec | None
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.window <= 0 or self.head_dim <= 0:
            raise ValueError(f"window = {self.window} and head_dim = {self.head_dim} must be positive")
        if self.indexer is not None and self.indexer.ratio != self.compressor.ratio:
            raise ValueError(
                f"indexer ratio {self.indexer.ratio} differs from the compressor ratio {self.compressor.ratio}"
            )


@dataclass(slots=True)
class CompressorState:
    """A compressor's state after L tokens, versioned by its boundary ``b = ⌊L/r⌋·r``.

    entries: ``[N, D]`` — compressed entries for ``[0, b)`` (N = b / r), RMS-normed and rotated
        (RoPE at position ``w·r`` for entry w); immutable once formed (``compressed_kv`` /
        the indexer's keys of ``indexer_state``).
    pending_kv: ``[L − b, F]`` — projected source rows of the open group (``uncompressed_tail``).
    pending_gate: ``[L − b, F]`` — their gate logits, before the positional bias.
    prev_kv: ``[r, D]`` — overlapping compressors once N ≥ 1: the first halves of the rows of
        group N − 1, which entry N pools too; ``[0, D]`` otherwise.
    prev_gate: ``[r, D]`` or ``[0, D]`` — their gate logits, before the positional bias.
    """

    entries: Tensor
    pending_kv: Tensor
    pending_gate: Tensor
    prev_kv: Tensor
    prev_gate: Tensor

    @classmethod
    def empty(cls, spec: CompressorSpec, dtype: torch.dtype, device: torch.device) -> CompressorState:
        """The state of an empty prefix (L = 0)."""
        d, f = spec.head_dim, spec.row_width
        return cls(
            entries=torch.zeros((0, d), dtype=dtype, device=device),
            pending_kv=torch.zeros((0, f), dtype=dtype, device=device),
            pending_gate=torch.zeros((0, f), dtype=dtype, device=device),
            prev_kv=torch.zeros((0, d), dtype=dtype, device=device),
            prev_gate=torch.zeros((0, d), dtype=dtype, device=device),
        )

    @property
    def num_entries(self) -> int:
        return int(self.entries.shape[0])

    def clone(self) -> CompressorState:
        """An independent copy (no storage shared with this state)."""
        return CompressorState(
            self.entries.clone(),
            self.pending_kv.clone(),
            self.pending_gate.clone(),
            self.prev_kv.clone(),
            self.prev_gate.clone(),
        )


@dataclass(slots=True)
class CompressedLayerState:
    """What one CSA / HCA layer keeps for one sequence between chunks and decode steps, besides
    the rows of its local window (shared K = V rows, stored through
    :meth:`SequenceState.attention_kv` like every window's KV: ``swa_window``).

    num_tokens: L, the tokens this state summarises (the next chunk starts at position L).
    compressor: the main compressor (``compressed_kv`` + ``uncompressed_tail``).
    indexer: the CSA indexer's compressor (``indexer_state``); None for HCA. Always at the same
        boundary as ``compressor`` (same ratio, same tokens).
    spec: the geometry the state was built for.
    """

    spec: CompressedLayerSpec
    num_tokens: int
    compressor: CompressorState
    indexer: CompressorState | None = field(default=None)

    @classmethod
    def empty(cls, spec: CompressedLayerSpec, device: torch.device) -> CompressedLayerState:
        """The state of an empty prefix (L = 0)."""
        return cls(
            spec=spec,
            num_tokens=0,
            compressor=CompressorState.empty(spec.compressor, spec.dtype, device),
            indexer=None if spec.indexer is None else CompressorState.empty(spec.indexer, spec.dtype, device),
        )

    @property
    def boundary_tokens(self) -> int:
        """b = ⌊L/r⌋·r: the prefix the compressed entries cover (their version)."""
        return self.compressor.num_entries * self.spec.compressor.ratio

    def clone(self) -> CompressedLayerState:
        """An independent copy (no storage shared with this state)."""
        return CompressedLayerState(
            self.spec,
            self.num_tokens,
            self.compressor.clone(),
            None if self.indexer is None else self.indexer.clone(),
        )

    def check(self) -> None:
        """Raise ``RuntimeError`` unless every tensor has the shape L and the spec imply."""
        spec, n = self.spec, self.num_tokens
        b = n - n % spec.compressor.ratio
        parts: list[tuple[str, CompressorSpec, CompressorState]] = [("compressor", spec.compressor, self.compressor)]
        if spec.indexer is not None:
            if self.indexer is None:
                raise RuntimeError("CSA state without its indexer state")
            parts.append(("indexer", spec.indexer, self.indexer))
        elif self.indexer is not None:
            raise RuntimeError("HCA state with an indexer state")
        want: dict[str, tuple[int, int]] = {}
        got: dict[str, tuple[int, ...]] = {}
        for name, cspec, cstate in parts:
            n_entries = b // cspec.ratio
            prev = cspec.ratio if cspec.overlapping and n_entries else 0
            want |= {
                f"{name}.entries": (n_entries, cspec.head_dim),
                f"{name}.pending_kv": (n - b, cspec.row_width),
                f"{name}.pending_gate": (n - b, cspec.row_width),
                f"{name}.prev_kv": (prev, cspec.head_dim),
                f"{name}.prev_gate": (prev, cspec.head_dim),
            }
            got |= {
                f"{name}.entries": tuple(cstate.entries.shape),
                f"{name}.pending_kv": tuple(cstate.pending_kv.shape),
                f"{name}.pending_gate": tuple(cstate.pending_gate.shape),
                f"{name}.prev_kv": tuple(cstate.prev_kv.shape),
                f"{name}.prev_gate": tuple(cstate.prev_gate.shape),
            }
        bad = [f"{k} {got[k]} != {v}" for k, v in want.items() if got[k] != v]
        if bad:
            raise RuntimeError(f"compressed layer state at L = {n} is inconsistent: {'; '.join(bad)}")


class SequenceState(Protocol):
    """Per-sequence state the layers read and write during one forward chunk."""

    def attention_kv(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionKV:
        """Store the chunk's ``keys/values [T, H_kv, D]`` at ``positions [T]`` and return every
        key/value the chunk's queries may need (at least the layer's window before the chunk)."""
        ...

    def attention_pages(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionPages:
        """Store the chunk's keys and values as :meth:`attention_kv` does and return the layer's
        pages for the paged kernels (the Triton backend)."""
        ...

    def linear(self, layer: int) -> LinearLayerState:
        """The recurrent state of a linear layer; the layer replaces its fields in place."""
        ...

    def linear_checkpoints(self) -> tuple[int, ...]:
        """Offsets ``0 < o < T`` into the current chunk, ascending, where every linear layer
        hands a copy of its state after the chunk's first o tokens to :meth:`save_linear`
        (recurrent checkpoints taken inside a chunk); () for none."""
        ...

    def save_linear(self, layer: int, offset: int, state: LinearLayerState) -> None:
        """Keep ``state`` (a copy) as ``layer``'s state after the chunk's first ``offset`` tokens."""
        ...

    def compressed(self, layer: int, spec: CompressedLayerSpec) -> CompressedLayerState:
        """The state of a CSA / HCA layer (created empty, for L = 0, on first use); the layer
        replaces its fields in place.

        Raises:
            ValueError: ``spec`` differs from the spec the state was created with.
        """
        ...


@dataclass(frozen=True, slots=True)
class PackedStates:
    """Several sequences' chunks in one forward (continuous batching): the tokens of every
    sequence packed along T in order, ``states[i]`` owning ``positions[i]`` (the very tensor its
    chunk protocol handed out, ``[T_i]``). The dense parts of a layer (norms, projections of the
    MLP, the LM head) run once over ``[ΣT_i, C]``; the mixers, which read and write per-sequence
    state, run per sequence through :func:`per_sequence`."""

    states: tuple[SequenceState, ...]
    positions: tuple[Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.states) != len(self.positions) or not self.states:
            raise ValueError(f"{len(self.states)} states for {len(self.positions)} position tensors")

    @property
    def lengths(self) -> list[int]:
        return [int(p.shape[0]) for p in self.positions]


MixerCall = Callable[[Tensor, Tensor, "tuple[Tensor, Tensor] | None", SequenceState], Tensor]


def per_sequence(mix: MixerCall, h: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor] | None, state: SequenceState | PackedStates) -> Tensor:
    """``mix(h, positions, rope, state)`` for one sequence, or once per sequence of a
    :class:`PackedStates` on its slice of ``h [ΣT_i, C]`` and of the rotary tables, with its own
    state and positions; the outputs packed back in order."""
    if not isinstance(state, PackedStates):
        return mix(h, positions, rope, state)
    outputs: list[Tensor] = []
    start = 0
    for seq_state, seq_positions in zip(state.states, state.positions, strict=True):
        end = start + int(seq_positions.shape[0])
        part = None if rope is None else (rope[0][start:end], rope[1][start:end])
        outputs.append(mix(h[start:end], seq_positions, part, seq_state))
        start = end
    if start != h.shape[0]:
        raise RuntimeError(f"packed states cover {start} tokens of {h.shape[0]}")
    return torch.cat(outputs)


class DenseState:
    """A cache-free state: KV appended to plain tensors, recurrent state from zeros.

    Used by the reference path and by tests; it never touches a cache pool.
    """

    def __init__(self, linear_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], device: torch.device) -> None:
        self._device = device
        self._kv: dict[int, AttentionKV] = {}
        self._compressed: dict[int, CompressedLayerState] = {}
        self._linear = {
            layer: LinearLayerState(
                torch.zeros(conv_shape, dtype=torch.float32, device=device),
                torch.zeros(rec_shape, dtype=torch.float32, device=device),
            )
            for layer, (conv_shape, rec_shape) in linear_shapes.items()
        }

    def attention_kv(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionKV:
        prev = self._kv.get(layer)
        if prev is not None:
            keys = torch.cat((prev.keys, keys))
            values = torch.cat((prev.values, values))
            positions = torch.cat((prev.positions, positions))
        kv = AttentionKV(keys, values, positions)
        self._kv[layer] = kv
        return kv

    def attention_pages(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionPages:
        kv = self.attention_kv(layer, positions, keys, values)
        if int(kv.positions[0]) != 0:
            raise RuntimeError(f"layer {layer}: dense keys start at position {int(kv.positions[0])}, not 0")
        return as_pages(kv.keys, kv.values)

    def linear(self, layer: int) -> LinearLayerState:
        return self._linear[layer]

    def linear_checkpoints(self) -> tuple[int, ...]:
        return ()

    def save_linear(self, layer: int, offset: int, state: LinearLayerState) -> None:
        raise RuntimeError("a dense state asks for no checkpoints inside a chunk")

    def compressed(self, layer: int, spec: CompressedLayerSpec) -> CompressedLayerState:
        state = self._compressed.get(layer)
        if state is None:
            state = self._compressed[layer] = CompressedLayerState.empty(spec, self._device)
        elif state.spec != spec:
            raise ValueError(f"layer {layer}: compressed state built for {state.spec}, asked for {spec}")
        return state

    def kv(self, layer: int) -> AttentionKV | None:
        """Every key/value stored so far for an attention layer (None before its first chunk)."""
        return self._kv.get(layer)
