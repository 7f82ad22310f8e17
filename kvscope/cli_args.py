"""Argument types and shared settings of the ``kvscope`` command line: validated numbers, the
replay and cache flags, and :class:`UserError` (what a subcommand raises for input the user can
fix)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cache.config import CacheConfig

if TYPE_CHECKING:
    from engine.trace.replay import ReplayConfig


def number(text: str, kind: type[int] | type[float], what: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    value = int(number(text, int, "a positive integer"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(number(text, int, "a non-negative integer"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative integer")
    return value


def port(text: str) -> int:
    value = int(number(text, int, "a TCP port (1..65535)"))
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1..65535)")
    return value


def positive_float(text: str) -> float:
    value = float(number(text, float, "a positive number"))
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def non_negative_float(text: str) -> float:
    value = float(number(text, float, "a non-negative number"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number")
    return value


def squeeze(text: str) -> object:
    from kvscope.replaying import PoolSqueeze

    try:
        return PoolSqueeze.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """The prefix cache's sizing flags (``kvscope up``, ``replay`` and ``serve``); read back by
    :func:`cache_config`."""
    defaults = CacheConfig()
    p.add_argument("--unit-tokens", type=positive_int, default=defaults.unit_tokens, help="prefix-match unit U in tokens; recurrent checkpoints every 8·U, prefill chunks of at most 32·U (default: %(default)s)")
    p.add_argument("--full-kv-blocks", type=positive_int, default=defaults.full_kv_blocks, help="full_kv pool pages (default: %(default)s)")
    p.add_argument("--swa-blocks", type=positive_int, default=defaults.swa_blocks, help="swa_window pool pages (default: %(default)s)")
    p.add_argument("--linear-checkpoints", type=positive_int, default=defaults.linear_checkpoints, help="linear_state checkpoint slots (default: %(default)s)")
    p.add_argument("--compressed-blocks", type=positive_int, default=defaults.compressed_blocks, help="pages per compressed_kv / indexer key pool (default: %(default)s)")
    p.add_argument("--tail-slots", type=positive_int, default=defaults.tail_slots, help="uncompressed_tail / indexer pending-row slots (default: %(default)s)")
    p.add_argument(
        "--tail-replay", default=defaults.tail_replay, choices=("off", "fallback", "on", "only"),
        help="rebuild linear_state by replaying the last tokens (approximate, flagged): fallback only when no exact "
        "checkpoint is within the replay budget, on always, only: on and no recurrent checkpoints stored (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--host-tier-mib", type=non_negative_int, default=0, help="host-memory tier every evicted object is copied down to, in MiB; 0: off (default: %(default)s)")
    p.add_argument("--disk-tier-mib", type=non_negative_int, default=0, help="disk tier below the host tier, in MiB; 0: off (default: %(default)s)")
    p.add_argument("--disk-tier-dir", type=Path, default=None, help="the disk tier's files, found again on restart; None: up puts them in tiers/ under --data-dir, replay and serve need it with --disk-tier-mib (default: %(default)s)")
    p.add_argument("--cache-memory-mib", type=positive_int, default=None, help="one byte budget (MiB) for every pool: a memory plan replaces the block counts above; None: the block counts (default: %(default)s)")


ENGINE_ID_HELP = (
    "the engine's name on its events, metrics, seqs and spool file, kept across restarts (each start is a new run id "
    "beside it); letters, digits, '.', '_', '-' (default: derived from host and model: HOST-MODEL)"
)
"""The help of ``--engine-id`` (``kvscope up``, ``replay`` and ``serve``)."""


def engine_id_arg(args: argparse.Namespace) -> str:
    """``--engine-id`` checked (:func:`engine.identity.check_engine_id`), else
    :func:`engine.identity.derived_engine_id` of this host and ``--model``.

    Raises:
        UserError: the id given has characters or a length the engine id does not allow.
    """
    from engine.identity import check_engine_id, derived_engine_id

    if args.engine_id is None:
        return derived_engine_id(str(args.model))
    try:
        return check_engine_id(args.engine_id)
    except ValueError as exc:
        raise UserError(f"--engine-id: {exc}") from None


def add_replay_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="kvscope_hybrid-small", help="preset name or model directory (default: %(default)s, trained)")
    p.add_argument("--engine-id", default=None, help=ENGINE_ID_HELP)
    p.add_argument("--speed", type=positive_float, default=30.0, help="trace seconds per wall second (default: %(default)s)")
    p.add_argument("--max-wait-seconds", type=float, default=1.0, help="cap on one wait between arrivals (default: %(default)s)")
    p.add_argument("--max-requests", type=positive_int, default=None, help="stop after N requests")
    p.add_argument("--block-tokens", type=positive_int, default=None, help="tokens per trace block in the replay (default: the trace's block size / 16)")
    p.add_argument("--max-output-tokens", type=int, default=16, help="cap on decoded tokens per request (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=positive_int, default=8, help="requests out at once, first arrival first (kvscope serve's flag of that name caps the running ones; default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=256, help="tokens computed per engine step, as kvscope serve's flag (default: %(default)s)")
    add_cache_flags(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")


class UserError(Exception):
    """An error the user can fix (bad input, bad config, an unreachable agent)."""


CACHE_FLAGS = {
    "CacheConfig.unit_tokens": "--unit-tokens",
    "CacheConfig.full_kv_blocks": "--full-kv-blocks",
    "CacheConfig.swa_blocks": "--swa-blocks",
    "CacheConfig.linear_checkpoints": "--linear-checkpoints",
    "CacheConfig.compressed_blocks": "--compressed-blocks",
    "CacheConfig.tail_slots": "--tail-slots",
    "CacheConfig.memory_bytes": "--cache-memory-mib",
    "CacheConfig.host_tier_bytes": "--host-tier-mib",
    "CacheConfig.disk_tier_bytes": "--disk-tier-mib",
    "CacheConfig.disk_tier_dir": "--disk-tier-dir",
    "CacheConfig.tail_replay": "--tail-replay",
}


def cache_error(exc: Exception) -> UserError:
    """A cache configuration error, worded with the flags the user typed."""
    text = str(exc)
    for field, flag in CACHE_FLAGS.items():
        text = text.replace(field, flag)
    return UserError(text)


def cache_config(args: argparse.Namespace) -> CacheConfig:
    """The cache of the flags of :func:`add_cache_flags`: the checkpoint interval (8·U) and the
    prefill chunk (32·U) follow the prefix-match unit U (``--unit-tokens``); sizes given in MiB
    become bytes; without ``--disk-tier-dir`` a disk tier goes to ``tiers/`` under ``--data-dir``
    where the command has one (``kvscope up``).

    Raises:
        UserError: an invalid combination, worded with the flags (:func:`cache_error`).
    """
    disk_dir = args.disk_tier_dir
    if disk_dir is None and args.disk_tier_mib and getattr(args, "data_dir", None) is not None:
        disk_dir = args.data_dir / "tiers"
    try:
        return CacheConfig(
            unit_tokens=args.unit_tokens,
            full_kv_blocks=args.full_kv_blocks,
            swa_blocks=args.swa_blocks,
            linear_checkpoints=args.linear_checkpoints,
            compressed_blocks=args.compressed_blocks,
            tail_slots=args.tail_slots,
            checkpoint_interval_tokens=8 * args.unit_tokens,
            max_prefill_chunk_tokens=32 * args.unit_tokens,
            memory_bytes=None if args.cache_memory_mib is None else args.cache_memory_mib * 2**20,
            tail_replay=args.tail_replay,
            host_tier_bytes=args.host_tier_mib * 2**20,
            disk_tier_bytes=args.disk_tier_mib * 2**20,
            disk_tier_dir=str(disk_dir) if disk_dir is not None else None,
        )
    except ValueError as exc:
        raise cache_error(exc) from None


def replay_config(args: argparse.Namespace) -> tuple[ReplayConfig, CacheConfig]:
    """Replay and cache settings from the flags (the cache's: :func:`cache_config`)."""
    from engine.trace.replay import ReplayConfig

    try:
        replay = ReplayConfig(
            block_tokens=args.block_tokens,
            speed=args.speed,
            max_wait_seconds=args.max_wait_seconds,
            max_requests=args.max_requests,
            max_output_tokens=args.max_output_tokens,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except ValueError as exc:
        raise cache_error(exc) from None
    return replay, cache_config(args)
