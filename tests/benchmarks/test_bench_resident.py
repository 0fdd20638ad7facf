"""bench_resident on a tiny random-weight Llama: each service's proportional set size read before and
after the requests, the shared KV pool counted once, the ratio computed from them, and no process or
shared-memory segment left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.stack import shm_segments
from pagedserve_testing.tiny_model import build_service_model

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def test_tiny_run_reads_every_service_and_cleans_up(tmp_path: Path) -> None:
    model = build_service_model(tmp_path / "model")
    cmd = [sys.executable, "-m", "benchmarks.bench_resident", "--model", str(model.path), "--kv-cache-bytes",
           str(4 << 20), "--requests", "2", "--prompt-tokens", "48", "--max-tokens", "4", "--idle-s", "1.5"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    assert summary["kv_pool_mib"] == 4.0
    assert summary["file_mib"] == round(sum(f.stat().st_size for f in model.path.glob("*.safetensors")) / MIB, 1)
    for moment in ("loaded", "after_requests", "idle"):
        assert sorted(summary["pss_mib"][moment]) == ["compute", "gateway", "memory"]
        assert all(value > 0 for value in summary["pss_mib"][moment].values())
    # The pool is mapped by memory and compute: its pages count half in each, once in the sum.
    assert abs(summary["shmem_mib"]["memory"] + summary["shmem_mib"]["compute"] - 4.0) < 0.5
    assert summary["shmem_mib"]["gateway"] == 0
    total = sum(summary["pss_mib"]["after_requests"].values())
    assert summary["total_pss_mib"] == round(total, 1)
    # (file_mib is rounded to 0.1 MiB: 0.4 MiB here, so the ratio from it is within a few percent)
    assert summary["ratio_to_file_plus_pool"] == pytest.approx(total / (summary["file_mib"] + 4.0), rel=0.05)

    assert summary["exit_statuses"] == {"gateway": 0, "compute_service": 0, "memory_service": 0}
    for pid in summary["pids"].values():
        assert not Path(f"/proc/{pid}").exists()
    assert not shm_segments(summary["pids"]["memory"])
