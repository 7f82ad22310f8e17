"""Where an engine runs and what it is called: the device it resolves and its engine id."""

from __future__ import annotations

import os
import socket
import time

import torch


def default_engine_id() -> str:
    """``host-pid-start``: unique per engine run (the start time, hex milliseconds, tells apart
    two runs that got the same pid), so each run's batch seqs start at 0 under their own id."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns() // 1_000_000:x}"


def resolve_device(device: str) -> torch.device:
    """``"auto"`` picks CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
