"""Shared test helpers: where the shared data lives, and the float32 tolerance table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}
"""Max abs difference allowed between a cached path and its reference, per dtype."""


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA
