"""bench_memory's --step-batch-sizes on a tiny random-weight Llama: one row per batch size with the
step RPC, the decode step and the RPC's share of it; bad batch sizes are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, tmp: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.bench_memory", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"TMPDIR": str(tmp)} if tmp else {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_step_batch_sizes_report_the_rpc_share_of_a_decode_step(make_tiny_model, tmp_path) -> None:
    tiny = make_tiny_model("llama")
    done = _run("--skip-inprocess", "--num-seqs", "4", "--iters", "20", "--step-batch-sizes", "2,5",
                "--model", str(tiny.path), tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # the memory service's socket directory is removed
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert "alloc_free_blocks_per_s" not in summary and summary["num_seqs"] == 4
    rows = summary["step_share"]
    assert [row["num_seqs"] for row in rows] == [2, 5]
    for row in rows:
        assert row["rpc_step_p50_us"] > 0 and row["engine_rpc_us"] > 0 and row["decode_step_ms"] > 0
        # The shares come from unrounded times; the reported times are rounded (0.01 ms, 0.1 us).
        step_us = row["decode_step_ms"] * 1000
        assert row["rpc_share"] == pytest.approx(row["rpc_step_p50_us"] / step_us, rel=0.02, abs=1e-5)
        assert row["engine_rpc_share"] == pytest.approx(row["engine_rpc_us"] / step_us, rel=0.02, abs=1e-5)
        assert 0 < row["engine_rpc_share"] < 1
        # Rule 7: decodes within their blocks send no RPC (20 steps of 16-token blocks: a few do).
        assert 0 < row["engine_rpcs_per_step"] < 1


def test_bad_step_batch_sizes_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_memory import main  # its parser, in this process: no interpreter and torch per case

    for bad in ("0,8", "8,x", ""):
        with pytest.raises(SystemExit) as exited:
            main(["--step-batch-sizes", bad])
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and "--step-batch-sizes" in stderr, stderr


def test_inprocess_run_counts_every_block_and_leaves_nothing() -> None:
    from benchmarks.memory.block_manager_bench import run_benchmark

    result = run_benchmark(num_sequences=300, num_blocks=16_384, repeats=1)
    # Every op is counted once, every allocated block once, and the run ends with an empty pool
    # (run_benchmark raises otherwise).
    assert result.num_ops > 300 and result.num_blocks_allocated > 300 * 4
    assert result.cpu_s > 0 and result.alloc_free_blocks_per_s == result.num_blocks_allocated / result.cpu_s
