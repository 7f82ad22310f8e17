"""The telemetry contract between the engine and the agent (DESIGN.md §5), version 1.

One module, imported by both sides, holds every enum and every event shape, so that a value the
engine can emit is exactly a value the agent accepts:

* :class:`Form`, :class:`Tier`, :class:`Outcome`, :class:`Reason`, :class:`Admission`,
  :class:`BlockAction` — the vocabulary of DESIGN.md §3;
* :class:`CacheLookup`, :class:`RequestEvent`, :class:`EngineStats`, :class:`BlockEvent` — the
  event kinds, tagged by their ``kind`` field;
* :class:`EventBatch` — what ``POST /v1/events`` carries;
* :func:`decode_batch` / :func:`encode_batch` — JSON and msgpack codecs that check types, ranges
  and the cross-field rules, raising :class:`EventError` with the field path and the reason.

Times are unix seconds (float). Token counts are ``*_tokens`` integers, byte counts ``*_bytes``.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

from engine import batch_scan

SCHEMA_VERSION = 1
"""Version of the batch schema; a batch with any other ``schema_version`` is rejected."""

MAX_EVENTS_PER_BATCH = 100_000
"""Upper bound on ``len(batch.events)``; larger batches are rejected as a whole."""


class Form(enum.StrEnum):
    """A cache form: the unit of validation, recovery and observability (DESIGN.md §3)."""

    FULL_KV = "full_kv"
    SWA_WINDOW = "swa_window"
    COMPRESSED_KV = "compressed_kv"
    UNCOMPRESSED_TAIL = "uncompressed_tail"
    INDEXER_STATE = "indexer_state"
    LINEAR_STATE = "linear_state"


class Tier(enum.StrEnum):
    """Where a cached object sits when it is looked up. ``host`` and ``disk`` make up the
    ``on_disk_prefix`` tier view of the dashboard."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class Outcome(enum.StrEnum):
    """What happened to one form of one request's matched prefix."""

    HIT = "hit"
    """Usable in place for the whole matched prefix."""
    RECOVERED = "recovered"
    """Usable after a swap-in or an exact rebuild without recomputation."""
    REPLAYED = "replayed"
    """Rebuilt by recomputing a suffix (Tail-Replay sets ``approximate``)."""
    INVALIDATED = "invalidated"
    """Present by hash but (partly) unusable; the reason says why."""
    MISS = "miss"
    """Nothing of this prefix was present."""


class Reason(enum.StrEnum):
    """Why a form (or a request's resume point) stopped short. ``none`` only goes with ``hit``."""

    NONE = "none"
    NO_PREFIX_MATCH = "no_prefix_match"
    PROMPT_END = "prompt_end"
    KV_EVICTED = "kv_evicted"
    BELOW_GRANULARITY = "below_granularity"
    COMPRESSED_EVICTED = "compressed_evicted"
    COMPRESSED_VERSION_MISMATCH = "compressed_version_mismatch"
    TAIL_MISSING = "tail_missing"
    TAIL_VERSION_MISMATCH = "tail_version_mismatch"
    SWA_EVICTED = "swa_evicted"
    INDEXER_STALE = "indexer_stale"
    LINEAR_CHECKPOINT_MISSING = "linear_checkpoint_missing"
    IN_FLIGHT_SWAP = "in_flight_swap"
    OFFLOAD_CORRUPT = "offload_corrupt"
    LAYOUT_MISMATCH = "layout_mismatch"
    MISALIGNED = "misaligned"
    GROUP_DISAGREE = "group_disagree"
    TP_DISAGREE = "tp_disagree"
    """Another tensor-parallel rank's shard of this form could not serve the point this rank's
    could (lost, corrupt, mid-swap, vetoed there); ``tp_rank`` names that rank."""
    EPOCH_CHANGED = "epoch_changed"
    """The state was replaced while the request used it, or a tier entry changed its epoch
    (dropped and stored again) while it was being swapped in: its read was refused."""
    ADMISSION_RECOMPUTE_CHEAPER = "admission_recompute_cheaper"
    RECOVERY_CAP_REACHED = "recovery_cap_reached"
    MODEL_REVISION_CHANGED = "model_revision_changed"
    TIER_INCOMPLETE = "tier_incomplete"
    """A lower tier holds this prefix's objects of some forms but not of this one: the others
    could be swapped in deeper, this form's state past its usable point is on no tier."""


EVICTION_REASONS = frozenset({Reason.KV_EVICTED, Reason.SWA_EVICTED, Reason.COMPRESSED_EVICTED, Reason.TAIL_MISSING})
"""Reasons that always say a form's state left the device (what a lower tier could have kept).
``linear_checkpoint_missing`` also covers a checkpoint never taken, so the planner asks the
form itself; ``indexer_stale`` stays what it is (case C9: a restore missing the index says so)."""

ABSENT_REASONS = EVICTION_REASONS | {Reason.INDEXER_STALE, Reason.LINEAR_CHECKPOINT_MISSING}
"""Reasons that can say a form's object is not on the device (a swap-in in flight could bring
it back): :data:`EVICTION_REASONS` and the two that may also mean evicted."""


class Admission(enum.StrEnum):
    """The plan the scheduler ran for a request."""

    COLD = "cold"
    """Full prefill, nothing reused."""
    EXACT = "exact"
    """Exact resume at L* from state in place."""
    SWAP_IN = "swap_in"
    LOWER_RESUME = "lower_resume"
    TAIL_REPLAY = "tail_replay"


class BlockAction(enum.StrEnum):
    """Fine-grained block events, in vLLM's KV-event vocabulary."""

    STORED = "stored"
    REMOVED = "removed"
    OFFLOADED = "offloaded"
    RESTORED = "restored"
    CLEARED = "cleared"
    """Every block of the form on that tier was dropped at once (vLLM's ``AllBlocksCleared``;
    ``block_hash`` is ``*``)."""


NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
"""Counts, ids and byte sizes: they fit a BIGINT column."""
Tokens = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
"""Token counts: at most 2⁴⁰ per event, so sums over a whole batch cannot overflow 64 bits."""
SmallInt = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
"""Indices stored as INTEGER (layer group, tensor-parallel rank)."""
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
"""Durations in seconds: finite, at most 10⁹ (about 31 years), so sums stay finite."""
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**48)]
"""Bytes moved by one lookup: at most 256 TiB, so per-minute sums cannot overflow 64 bits."""
UnixSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=253_402_300_799.0)]
"""A time as unix seconds, at most 9999-12-31T23:59:59Z (what a TIMESTAMP column holds)."""
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
RunId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9._-]+$")]
"""A run id (:func:`engine.identity.new_run_id`): at most 64 letters, digits, ``.``, ``_``, ``-``."""


class _Event(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", kw_only=True, gc=False):
    # gc=False: events hold only scalars and strings (no reference cycles possible), so the
    # cyclic garbage collector need not track the millions of them an agent decodes.
    ts: UnixSeconds
    engine_id: Name


class CacheLookup(_Event, tag="cache_lookup", kw_only=True):
    """One per (request, form). ``usable_tokens`` is this form's own longest exact resume point
    ≤ the hash hit; ``recoverable_tokens`` = min(usable, L*) when the form was used."""

    request_id: Name
    model: Name
    form: Form
    tier: Tier
    outcome: Outcome
    reason: Reason
    hash_hit_tokens: Tokens
    usable_tokens: Tokens
    recoverable_tokens: Tokens
    replayed_tokens: Tokens = 0
    approximate: bool = False
    recovery_seconds: NonNegFloat = 0.0
    bytes_moved: Bytes = 0
    layer_group: SmallInt = 0
    tp_rank: SmallInt = 0
    epoch: NonNegInt = 0
    ghost_tokens: Tokens = 0
    """When the form lost tokens to evictions: the resume point it would have had with
    ``ghost_bytes`` more device memory for it (0: none). The Capacity what-if reads these."""
    ghost_bytes: Bytes | None = None
    """That extra memory (None: more memory would not have helped, or not known)."""
    spare_bytes: Bytes | None = None
    """When the form could resume (``usable_tokens`` > 0): how much less device memory it could
    have had and still resumed there (None: not known). The Capacity what-if reads these."""
    indexer_sync_delay_tokens: Tokens = 0
    """``indexer_state`` only: how many tokens the indexer's state trails the main compressed KV
    boundary where the lookup met it (per CSA layer group, the group ``layer_group`` names; 0:
    in sync, as in a healthy engine). See ``engine/cache/indexer_sync.py``."""
    indexer_sync_delay_seconds: NonNegFloat = 0.0
    """``indexer_state`` only: seconds since that indexer state last matched the boundary (0 when
    ``indexer_sync_delay_tokens`` is 0)."""


class RequestEvent(_Event, tag="request", kw_only=True):
    """One per request. Always ``prompt_tokens == recoverable_tokens + replayed_tokens +
    recomputed_tokens``."""

    request_id: Name
    model: Name
    prompt_tokens: Tokens
    output_tokens: Tokens
    hash_hit_tokens: Tokens
    resume_tokens: Tokens
    recoverable_tokens: Tokens
    replayed_tokens: Tokens
    recomputed_tokens: Tokens
    approximate: bool = False
    limiting_form: Form | None = None
    limiting_reason: Reason = Reason.NONE
    limiting_forms: tuple[Form, ...] = ()
    """The limiting forms, in :class:`Form` order: of the forms that lost tokens, those with the
    smallest usable length (the forms whose usable length equals L* whenever one does; after a
    swap-in, usable in the tier view). ``limiting_form`` is the one named among them by the rule
    of docs/cache-forms.md; more than one is a tie. Empty when no form lowered L*."""
    admission: Admission
    ttft_seconds: NonNegFloat
    e2e_seconds: NonNegFloat
    predicted_seconds: NonNegFloat = 0.0
    """The admission's predicted seconds for the chosen plan (recovery + prefill)."""
    actual_seconds: NonNegFloat = 0.0
    """Measured seconds of the same span (admission to the end of the prefill)."""


class EngineStats(_Event, tag="engine_stats", kw_only=True):
    """Periodic occupancy of one (form, tier) pool plus the engine's queue figures."""

    model: Name
    form: Form
    tier: Tier
    used_bytes: NonNegInt
    used_blocks: NonNegInt
    cached_blocks: NonNegInt
    free_blocks: NonNegInt
    total_blocks: NonNegInt
    running_requests: NonNegInt = 0
    waiting_requests: NonNegInt = 0
    recoveries_in_flight: NonNegInt = 0


class BlockEvent(_Event, tag="block", kw_only=True):
    """Optional audit trail of one block (or checkpoint) of one form."""

    model: Name
    form: Form
    tier: Tier
    action: BlockAction
    block_hash: Name
    block_id: NonNegInt
    num_tokens: Tokens


Event = CacheLookup | RequestEvent | EngineStats | BlockEvent


class EventBatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The body of ``POST /v1/events``."""

    schema_version: int
    engine_id: Name
    seq: NonNegInt
    sent_at: UnixSeconds
    events: list[Event]
    run_id: RunId | None = None
    """The engine process that sent the batch (new at every start, while ``engine_id`` stays):
    on the envelope, not on each event, since one batch comes from one run. The agent stores it
    beside every row of the batch. Optional: batches of older engines have none (NULL)."""


class EventError(ValueError):
    """A batch that breaks the contract. ``path`` names the field (``$.events[3].form``)."""

    def __init__(self, path: str, reason: str, *, column: str | None = None, row: int | None = None) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.column = column
        """The column an Arrow batch's error is in (:mod:`engine.events_arrow_check`)."""
        self.row = row
        """The first bad row of that column, counted within its kind's stream."""


_json_decoder = msgspec.json.Decoder(EventBatch)
_msgpack_decoder = msgspec.msgpack.Decoder(EventBatch)
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()

ContentFormat = Literal["json", "msgpack"]


def decode_batch(body: bytes, fmt: ContentFormat = "json") -> EventBatch:
    """Decode and validate one batch.

    Raises:
        EventError: the body is not valid JSON/msgpack, a field has the wrong type or range, an
            unknown field or event kind appears, a value is nested deeper than msgspec's
            recursion allows (the path found by :func:`engine.batch_scan.too_deep`), or a
            cross-field rule fails (see :func:`check_batch`). Nothing of a rejected batch may be
            stored.
    """
    decoder = _json_decoder if fmt == "json" else _msgpack_decoder
    try:
        batch = decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path = "$"
        if " - at `" in message:
            message, _, rest = message.partition(" - at `")
            path = rest.rstrip("`")
        raise EventError(path, message) from None
    except msgspec.DecodeError as exc:
        raise EventError("$", f"malformed {fmt} body: {exc}") from None
    except RecursionError:  # msgspec skipping a value nested past Python's recursion limit
        path = batch_scan.too_deep(body, fmt) or "$"
        raise EventError(path, f"nested more than {batch_scan.NESTING_LIMIT} levels deep (the batch schema needs 3)") from None
    check_batch(batch)
    return batch


def check_batch(batch: EventBatch) -> None:
    """Check the rules a type system cannot express.

    Raises:
        EventError: wrong ``schema_version``; too many events; an event whose ``engine_id``
            differs from the batch's; a ``hit`` with a reason or a non-hit without one; a
            ``cache_lookup`` whose usable, recoverable or ghost tokens exceed its hash hit, with
            ``ghost_bytes`` but no ``ghost_tokens`` (or the reverse), ``ghost_bytes`` 0, or
            ``ghost_tokens`` not past ``usable_tokens``, or ``spare_bytes`` without usable
            tokens, or an indexer sync delay on another form than ``indexer_state``, in seconds
            without one in tokens, or past its hash hit; a ``request`` whose token split does not add up to its prompt, or whose
            non-empty ``limiting_forms`` misses its ``limiting_form`` or repeats a form.
    """
    if batch.schema_version != SCHEMA_VERSION:
        raise EventError(
            "$.schema_version",
            f"unsupported schema_version {batch.schema_version}; this agent accepts {SCHEMA_VERSION}",
        )
    if len(batch.events) > MAX_EVENTS_PER_BATCH:
        raise EventError("$.events", f"{len(batch.events)} events exceed the limit of {MAX_EVENTS_PER_BATCH}")
    for i, ev in enumerate(batch.events):
        at = f"$.events[{i}]"
        if ev.engine_id != batch.engine_id:
            raise EventError(f"{at}.engine_id", f"{ev.engine_id!r} differs from the batch's engine_id {batch.engine_id!r}")
        if isinstance(ev, CacheLookup):
            if (ev.outcome == Outcome.HIT) != (ev.reason == Reason.NONE):
                raise EventError(f"{at}.reason", f"outcome {ev.outcome} cannot carry reason {ev.reason}")
            if ev.usable_tokens > ev.hash_hit_tokens:
                raise EventError(f"{at}.usable_tokens", "exceeds hash_hit_tokens")
            if ev.recoverable_tokens > ev.usable_tokens:
                raise EventError(f"{at}.recoverable_tokens", "exceeds usable_tokens")
            if ev.ghost_tokens > ev.hash_hit_tokens:
                raise EventError(f"{at}.ghost_tokens", "exceeds hash_hit_tokens")
            if (ev.ghost_bytes is None) != (ev.ghost_tokens == 0):
                raise EventError(f"{at}.ghost_bytes", "ghost_bytes and a non-zero ghost_tokens go together")
            if ev.ghost_bytes == 0:
                raise EventError(f"{at}.ghost_bytes", "must be > 0: a ghost point needs more memory")
            if ev.ghost_tokens and ev.ghost_tokens <= ev.usable_tokens:
                raise EventError(f"{at}.ghost_tokens", "must exceed usable_tokens")
            if ev.spare_bytes is not None and ev.usable_tokens == 0:
                raise EventError(f"{at}.spare_bytes", "only a lookup with usable tokens has spare memory")
            if ev.indexer_sync_delay_tokens or ev.indexer_sync_delay_seconds:
                _check_sync_delay(ev, at)
        elif isinstance(ev, RequestEvent):
            total = ev.recoverable_tokens + ev.replayed_tokens + ev.recomputed_tokens
            if total != ev.prompt_tokens:
                raise EventError(
                    f"{at}.prompt_tokens",
                    f"recoverable + replayed + recomputed = {total} != prompt_tokens {ev.prompt_tokens}",
                )
            if ev.recoverable_tokens > ev.hash_hit_tokens:
                raise EventError(f"{at}.recoverable_tokens", "exceeds hash_hit_tokens")
            if ev.resume_tokens >= max(ev.prompt_tokens, 1):
                raise EventError(f"{at}.resume_tokens", "must be below prompt_tokens")
            if ev.limiting_forms:
                if ev.limiting_form not in ev.limiting_forms:
                    raise EventError(f"{at}.limiting_forms", f"does not contain limiting_form {ev.limiting_form}")
                if len(set(ev.limiting_forms)) != len(ev.limiting_forms):
                    raise EventError(f"{at}.limiting_forms", "names a form twice")


def _check_sync_delay(ev: CacheLookup, at: str) -> None:
    if ev.form != Form.INDEXER_STATE:
        raise EventError(f"{at}.indexer_sync_delay_tokens", f"only an indexer_state lookup has a sync delay, not {ev.form}")
    if not ev.indexer_sync_delay_tokens:
        raise EventError(f"{at}.indexer_sync_delay_seconds", "must be 0 while indexer_sync_delay_tokens is 0 (in sync)")
    if ev.indexer_sync_delay_tokens > ev.hash_hit_tokens:
        raise EventError(f"{at}.indexer_sync_delay_tokens", "exceeds hash_hit_tokens")


def encode_batch(batch: EventBatch, fmt: ContentFormat = "json") -> bytes:
    """Serialise a batch for ``POST /v1/events`` (content type ``application/json`` or
    ``application/msgpack``)."""
    return (_json_encoder if fmt == "json" else _msgpack_encoder).encode(batch)
