"""vLLM's KV-cache events, as its ZMQ publisher sends them, turned into kvscope ``block`` events.

vLLM (``vllm.distributed.kv_events``, 0.32) publishes one ``KVEventBatch`` per engine step on a
ZMQ PUB socket as three frames: the topic, the batch's seq (8 bytes, big-endian, from 0 at each
start of the publisher) and the batch as msgpack (msgspec: the batch an array ``[ts, events,
data_parallel_rank]``, each event a map tagged by its class name). The structs here decode
that layout (unknown fields are ignored, so a newer vLLM adding fields still decodes); a frame
that does not decode raises :class:`VllmEventError`, never anything else.

What maps (docs/vllm.md has the table):

* ``BlockStored`` → one ``stored`` row per block hash, ``BlockRemoved`` → one ``removed`` row per
  hash, ``AllBlocksCleared`` → one ``cleared`` row per form seen so far.
* ``medium`` → tier: ``GPU`` (or none) ``device``, ``CPU`` ``host``, ``STORAGE`` ``disk``.
* the KV cache group → form, by the ``kv_cache_spec_kind`` its stored events carry
  (``full_attention`` / ``mla_attention`` / ``sink_full_attention`` → ``full_kv``,
  ``sliding_window`` / ``sliding_window_mla`` / ``chunked_local_attention`` → ``swa_window``,
  ``mamba`` → ``linear_state``); a removal carries only the group index, so the form learned
  from that group's stores is used (``full_kv`` for a group never seen stored).
* ``block_hash``: the hash as hex (bytes) or decimal (int); ``num_tokens``: ``block_size``.

What vLLM's events cannot say: a block id (``block_id`` is 0), the model (the subscriber's
configured name), a usable length short of the block, why a block was removed, and any
per-request hit or recovery (no ``cache_lookup`` rows come from vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from engine.events import BlockAction, BlockEvent, Form, Tier


class VllmEventError(ValueError):
    """A ZMQ message that is not a vLLM KV-event batch (names what is wrong)."""


class BlockStored(msgspec.Struct, tag="BlockStored", kw_only=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", kw_only=True):
    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    """``[ts (unix seconds), events, data_parallel_rank]`` (the rank is absent in older vLLMs)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)

FORM_OF_SPEC_KIND: dict[str, Form] = {
    "full_attention": Form.FULL_KV,
    "mla_attention": Form.FULL_KV,
    "sink_full_attention": Form.FULL_KV,
    "sliding_window": Form.SWA_WINDOW,
    "sliding_window_mla": Form.SWA_WINDOW,
    "chunked_local_attention": Form.SWA_WINDOW,
    "mamba": Form.LINEAR_STATE,
}
"""vLLM's ``KVCacheSpecKind`` values → kvscope forms (kinds not listed are stored as ``full_kv``)."""

TIER_OF_MEDIUM: dict[str | None, Tier] = {None: Tier.DEVICE, "GPU": Tier.DEVICE, "CPU": Tier.HOST, "STORAGE": Tier.DISK}
"""vLLM's ``medium`` values → kvscope tiers (another medium is stored as ``disk``: off the device)."""


@dataclass(frozen=True, slots=True)
class VllmMessage:
    """One decoded ZMQ message: its topic, vLLM's seq and the batch."""

    topic: bytes
    seq: int
    batch: KVEventBatch


def decode_message(frames: list[bytes]) -> VllmMessage:
    """``[topic, seq (8 bytes big-endian), payload]`` → :class:`VllmMessage`.

    Raises:
        VllmEventError: another number of frames, a seq of another width or negative, a payload
            that is not a KV-event batch.
    """
    if len(frames) != 3:
        raise VllmEventError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise VllmEventError(f"the seq frame has {len(seq_bytes)} bytes, expected 8")
    try:
        batch = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise VllmEventError(f"payload is not a vLLM KV-event batch: {exc}") from None
    seq = int.from_bytes(seq_bytes, "big")
    if seq >= 2**63:  # vLLM's seqs count up from 0 (its replay's end marker, -1, never comes here)
        raise VllmEventError(f"the seq frame holds {seq - 2**64}, not a batch's seq (>= 0)")
    return VllmMessage(topic, seq, batch)


def hash_text(block_hash: bytes | int) -> str:
    """A block hash as stored in ``block_events.block_hash``: hex for bytes, decimal for ints."""
    return block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)


@dataclass
class GroupForms:
    """What the subscriber learned of vLLM's KV cache groups from their stored events: each
    group's form and block size (a removal carries neither)."""

    forms: dict[int | None, Form] = field(default_factory=dict)
    block_sizes: dict[int | None, int] = field(default_factory=dict)

    def learn(self, event: BlockStored) -> Form:
        form = FORM_OF_SPEC_KIND.get(event.kv_cache_spec_kind or "", self.forms.get(event.group_idx, Form.FULL_KV))
        self.forms[event.group_idx] = form
        self.block_sizes[event.group_idx] = event.block_size
        return form


def block_events(batch: KVEventBatch, *, engine_id: str, model: str, groups: GroupForms) -> list[BlockEvent]:
    """kvscope ``block`` events for one vLLM batch, in its order (``ts`` is the batch's)."""
    out: list[BlockEvent] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            form = groups.learn(event)
            tier = _tier(event.medium)
            out.extend(
                _row(batch.ts, engine_id, model, form, tier, BlockAction.STORED, hash_text(h), max(event.block_size, 0)) for h in event.block_hashes
            )
        elif isinstance(event, BlockRemoved):
            form = groups.forms.get(event.group_idx, Form.FULL_KV)
            tokens = groups.block_sizes.get(event.group_idx, 0)
            tier = _tier(event.medium)
            out.extend(_row(batch.ts, engine_id, model, form, tier, BlockAction.REMOVED, hash_text(h), tokens) for h in event.block_hashes)
        else:
            for form in sorted(set(groups.forms.values()) or {Form.FULL_KV}):
                out.append(_row(batch.ts, engine_id, model, form, Tier.DEVICE, BlockAction.CLEARED, "*", 0))
    return out


def _tier(medium: str | None) -> Tier:
    return TIER_OF_MEDIUM.get(medium.upper() if medium else None, Tier.DISK)


def _row(ts: float, engine_id: str, model: str, form: Form, tier: Tier, action: BlockAction, block_hash: str, tokens: int) -> BlockEvent:
    return BlockEvent(ts=ts, engine_id=engine_id, model=model, form=form, tier=tier, action=action, block_hash=block_hash, block_id=0, num_tokens=tokens)

