"""Kernel tests run on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, as
``make test`` sets); otherwise they skip, saying so."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if DEVICE == "cpu" and not INTERPRETED:
        skip = pytest.mark.skip(reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (make test sets it)")
        for item in items:
            if "tests/kernels/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE
