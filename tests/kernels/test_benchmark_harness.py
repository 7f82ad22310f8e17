"""``benchmarks/kernels.py --smoke`` runs every kernel case at toy sizes and prints one JSON
object whose kernels agree with torch (the harness works; the GPU run gives the figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import TOLERANCE

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "kv_block_copy", "paged_decode_attention", "paged_prefill_attention", "compressor", "indexer_topk",
    "sparse_compressed_attention", "gated_delta_rule_chunked", "gated_delta_rule_recurrent", "causal_conv1d_update", "fused_moe",
}  # fmt: skip


def test_the_kernel_benchmark_runs_every_case_and_checks_it() -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0"),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    result = json.loads(lines[0])
    assert result["smoke"] is True and "skipped" not in result
    assert (
        result["copy_gb_per_s"] > 0
        and result["matrix_tflop_per_s_fp16"] > 0
        and result["matrix_tflop_per_s_fp32"] > 0
    )
    rows = {row["kernel"]: row for row in result["kernels"]}
    assert set(rows) == KERNELS
    for name, row in rows.items():
        assert row["max_abs_diff"] <= TOLERANCE[torch.float16], (
            name
        )  # index kernels count mismatches: 0
        assert row["kernel_ms"] > 0 and row["torch_ms"] > 0 and row["speedup_vs_torch"] > 0
        assert ("gb_per_s" in row) != ("tflop_per_s" in row), name  # one measure per kernel
