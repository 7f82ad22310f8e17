"""Timing the way up from a tier, for the admission's calibration (DESIGN.md §3 "Tiers").

The admission (:mod:`engine.cache.admission`) prices a swap-in against recomputation; it needs
the seconds one object takes to come back up from each tier on this machine.
:func:`round_trip` measures them through the tiers' own path: host copies, or tier files
(:mod:`engine.cache.tier_files`) written, dropped from the OS page cache, then read and verified
on as many threads as the tiers use (:data:`engine.cache.tier_copies.READ_WORKERS`).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from pathlib import Path

import torch

from engine.cache.tier_copies import READ_WORKERS
from engine.cache.tier_files import read_file, write_file
from engine.events import Reason, Tier


def round_trip(tier: Tier, directory: Path | None, nbytes: int, count: int = 1) -> float:
    """Copy ``count`` objects of ``nbytes`` down to ``tier`` and time bringing them back up
    together through the tier's own path (host: copies; disk: files written and dropped from the
    OS page cache, then read and verified on :data:`READ_WORKERS` threads); returns the seconds
    per object of the way up, for the admission's calibration.

    Raises:
        RuntimeError: a calibration file failed verification.
        OSError: the files cannot be written in ``directory``.
    """
    src = torch.zeros(nbytes, dtype=torch.uint8)
    if tier is Tier.HOST or directory is None:
        down = [src.clone() for _ in range(count)]
        t0 = time.perf_counter()
        for d in down:
            d.clone()
        return (time.perf_counter() - t0) / count
    paths = [directory / f"calibration-{os.getpid()}-{threading.get_ident()}-{i}.probe" for i in range(count)]
    try:
        for path in paths:
            write_file(path, {"x": src}, {"fingerprints": "{}"}, False)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):  # Linux: read from the disk, not the page cache
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        with concurrent.futures.ThreadPoolExecutor(max_workers=READ_WORKERS) as pool:
            t0 = time.perf_counter()
            results = list(pool.map(lambda p: read_file(p, {}), paths))
            seconds = time.perf_counter() - t0
        if any(isinstance(r, Reason) for r in results):
            raise RuntimeError(f"{directory}: a calibration file failed verification")
        return seconds / count
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
