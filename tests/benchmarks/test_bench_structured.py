"""bench_structured on the tiny byte-tokenizer Llama: one row per batch size, masks really applied
(one masked step per constrained decode step), JSON last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.structured.conftest import ByteModel

ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["tests.structured.conftest"]


def test_mask_cost_per_batch_size(byte_model: ByteModel) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_structured", "--model", str(byte_model.path),
                           "--batch-sizes", "1,3", "--steps", "4"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["batch_size"] for r in summary["results"]] == [1, 3]
    for row in summary["results"]:
        assert row["num_steps_timed"] >= 2
        assert 0 < row["mask_ms"] < row["step_ms_constrained"]
        assert row["mask_cpu_ms"] >= 0 and row["step_cpu_ms_unconstrained"] > 0
