"""bench_kv_tier at toy sizes on the tiny random-weight Llama with the byte tokenizer: every scenario
reports its figures, the tier's answers are the recomputed ones (after a SIGKILL mid-write, damaged
files and a full disk too), and its temporary directories (and the faults' tmpfs) are removed.

One run of the benchmark serves every test of this file: a process of its own pays its imports
(seconds on a loaded machine) once, and the scenarios share nothing but the temporary directory,
which must be empty after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve_testing.tiny_model import ServiceModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def summary(service_model: ServiceModel, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of every scenario: the returning ones at 96-token prompts (6 blocks), the no_reuse and
    faults ones --quick (the byte tokenizer with a chat template: the realistic prompts), float32."""
    work = tmp_path_factory.mktemp("bench-kv-tier")
    cmd = [sys.executable, "-m", "benchmarks.bench_kv_tier", "--model", str(service_model.path), "--vocab", "256",
           "--prompt-tokens", "96", "--pool-extra-tokens", "64", "--docs", "4", "--doc-tokens", "64",
           "--requests", "6", "--host-bytes", str(8 << 20), "--quick", "--dtype", "float32", "--probe-mb", "1",
           "--dir", str(work), "--scenarios",
           "returning,working_set,no_reuse,faults,returning_host,write_share"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(work.iterdir()) == []  # the faults' tmpfs unmounted, every directory removed
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bench_kv_tier_reports_every_scenario(summary: dict) -> None:
    returning, restart = summary["returning"], summary["warm_restart"]
    assert returning["same_tokens"] and restart["same_tokens"]
    assert returning["cached_share"] == 0.833 and returning["tier_loads"] >= 1  # 80 of 96 tokens: 5 blocks
    assert restart["cached_share"] == 0.833
    assert summary["working_set"]["tier"]["hit_rate"] >= summary["working_set"]["no_tier"]["hit_rate"]
    assert summary["working_set"]["tier"]["tier_loads"] >= 0 and "tier_loads" not in summary["working_set"]["no_tier"]
    assert summary["disk"]["cold_read_mb_s"] > 0


def test_bench_kv_tier_returning_host_scenario(summary: dict) -> None:
    """``--scenarios returning_host``: the returning prompt from the host tier and from the disk, each
    with the recomputed tokens and the cached share of the disk's."""
    figures = summary["returning_host"]
    assert figures["host_same_tokens"] and figures["disk_same_tokens"]
    assert figures["host_cached_share"] == figures["disk_cached_share"] == 0.833  # 80 of 96 tokens: 5 blocks
    assert figures["host_loads"] >= 1 and figures["disk_loads"] >= 1
    assert figures["host_speedup"] > 0 and figures["disk_speedup"] > 0


def test_bench_kv_tier_quick_no_reuse(summary: dict) -> None:
    no_reuse = summary["no_reuse"]
    assert no_reuse["tier_tok_s"] > 0 and no_reuse["no_tier_tok_s"] > 0 and len(no_reuse["pair_ratios"]) == 2
    assert [r["engine"] for r in no_reuse["runs"]] == ["tier", "no_tier", "no_tier", "tier"]  # alternating
    assert no_reuse["tier_bytes_written"] > 0 and no_reuse["tier_write_errors"] == 0
    assert no_reuse["tier_blocks_written"] + no_reuse["tier_blocks_missed"] > 0
    assert 0 < no_reuse["tier_written_share"] <= 1
    assert no_reuse["tier_loads"] == 0  # written, never read


def test_bench_kv_tier_quick_write_share(summary: dict) -> None:
    runs = summary["write_share"]["runs"]
    assert [r["gap_s"] for r in runs] == [0.1]
    for r in runs:
        assert r["full_blocks"] > 0 and 0 < r["engine_busy_share"] <= 1
        assert r["blocks_written"] + r["blocks_missed"] > 0 and 0 < r["written_share"] <= 1


def test_bench_kv_tier_quick_faults(summary: dict) -> None:
    faults = summary["faults"]
    killed = faults["sigkill_mid_write"]
    assert killed["same_tokens"] and killed["integrity_ok"] and killed["wave1_cached_share"] == 0.985  # 64 of 65
    assert killed["files_removed"] == 0 and killed["write_errors"] == 0 and killed["partial_files_left"] == 0
    opened = [json.loads(line) for line in killed["log_lines"] if '"kv_tier_opened"' in line]
    assert len(opened) == 1 and opened[0]["num_partial_writes_removed"] == killed["partial_files_at_kill"]

    damaged = faults["corrupt_files"]
    assert damaged["same_tokens"] and damaged["integrity_ok"] and damaged["files_removed"] == 2
    removed = {json.loads(line)["path"].rsplit("/", 1)[1]: json.loads(line)["problem"]
               for line in damaged["log_lines"] if "kv_tier_file_removed" in line}
    # 2 layers x K, V x 16 tokens x 2 KV heads x head dim 16 x 4 bytes (two pages), after a page of header
    assert removed == {damaged["flipped"]: "payload checksum mismatch",
                       damaged["truncated"]: "truncated (6144 bytes, expected 12288)"}
    assert damaged["cached_share"] < killed["wave1_cached_share"]  # what followed a bad block was recomputed

    full = faults["full_disk"]
    if faults["filesystem"] == "tmpfs":  # mount allowed here (CAP_SYS_ADMIN)
        assert full["same_tokens"] and full["integrity_ok"] and full["files_removed"] == 0
        # ENOSPC: the tier evicts its least recently used files and writes every block of wave 3
        assert full["write_errors"] == 0 and full["blocks_written"] == 2 * 4  # 2 prompts of 4 blocks
        [lowered] = [json.loads(line) for line in full["log_lines"]]
        assert (lowered["event"], lowered["error"]) == ("kv_tier_budget_lowered", "ENOSPC")
        assert full["fresh_service_starts"]
    else:
        assert "no tmpfs here" in full["skipped"]
