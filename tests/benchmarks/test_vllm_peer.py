"""The vLLM peer's parts that run without vLLM: arguments, environment, the side-by-side report.
No test installs or starts vLLM (issue 18); the peer runs only from the benchmarks' command lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_serving, bench_throughput, vllm_peer
from benchmarks.serving import vllm_client
from benchmarks.serving import peer as serving_peer
from benchmarks.serving.workload import RequestSpec
from benchmarks.throughput import peer as throughput_peer


def test_budgets_and_kv_space() -> None:
    assert throughput_peer.parse_budgets("256:2048, 128:4096:2") == [(256, 2048, 0), (128, 4096, 2)]
    assert throughput_peer.engine_args((128, 4096, 2))["speculative_config"]["num_speculative_tokens"] == 2
    assert "speculative_config" not in throughput_peer.engine_args((256, 2048, 0))
    for bad in ("256", "a:b", "0:2048", "", "256:2048:-1", "1:2:3:4"):
        with pytest.raises(ValueError):
            throughput_peer.parse_budgets(bad)
    assert vllm_peer.kv_space_gib(2 << 30) == 2
    for bad in (512 << 20, (1 << 30) + 1, 0):
        with pytest.raises(ValueError, match="whole number of GiB"):
            vllm_peer.kv_space_gib(bad)
    assert [vllm_peer.cpu_list(c) for c in ([0, 1], [1, 0], [3], [0, 2, 5])] == ["0-1", "0-1", "3", "0,2,5"]


def test_environment_pins_threads_preloads_and_drops_our_pythonpath(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    iomp.parent.mkdir(parents=True)
    iomp.write_bytes(b"")
    env, settings = vllm_peer.vllm_env(python, 1 << 30, cpus=[0, 1], base={"PYTHONPATH": "/ours", "HOME": "/h"})
    assert settings["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert settings["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and settings["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert str(iomp) in settings["LD_PRELOAD"].split(":")
    tcmalloc = vllm_peer.find_tcmalloc()
    assert (str(tcmalloc) in settings["LD_PRELOAD"]) if tcmalloc else True
    assert "PYTHONPATH" not in env and env["HOME"] == "/h" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_stale_kmp_files_of_dead_processes_are_removed_others_kept() -> None:
    before = vllm_peer.kmp_files()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(f"/dev/shm/__KMP_REGISTERED_LIB_{dead.pid}_0")
    alive = Path(f"/dev/shm/__KMP_REGISTERED_LIB_{os.getpid()}_0")
    stale.write_text("x")
    alive.write_text("x")
    try:
        assert vllm_peer.remove_stale_kmp_files(before) == [stale]
        assert not stale.exists() and alive.exists()
    finally:
        stale.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)


def test_throughput_peer_arguments() -> None:
    args = bench_throughput.parse_args(["--peer", "vllm", "--device", "cpu", "--max-num-batched-tokens", "4096"])
    assert args.kv_cache_bytes == 1 << 30 and args.baselines == []
    assert args.vllm_budgets == [(256, 4096, 0), (256, 4096, 2)]  # ours, with and without n-gram drafts
    args = bench_throughput.parse_args(["--peer", "vllm", "--device", "cpu", "--vllm-budgets", "64:1024,256:8192"])
    assert args.vllm_budgets == [(64, 1024, 0), (256, 8192, 0)]
    assert bench_throughput.parse_args(["--device", "cpu"]).kv_cache_bytes == 512 << 20  # unchanged without a peer
    with pytest.raises(SystemExit):
        bench_throughput.parse_args(["--peer", "vllm", "--device", "cpu", "--kv-cache-bytes", "512MiB"])


def test_serving_peer_arguments() -> None:
    args = bench_serving.parse_args(["--peer", "vllm", "--skip-prefix", "--rates", "1", "inf"])
    assert args.kv_cache_bytes == 1 << 30 and args.skip_prefix and args.peer == "vllm"
    assert bench_serving.parse_args([]).kv_cache_bytes == 512 << 20
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--peer", "vllm", "--kv-cache-bytes", str(3 << 29)])


def _run(rate: str, tpot_p50: float, ttft_p99: float, out_tok_s: float) -> dict:
    return {"rate": rate, "tpot_s": {"p50": tpot_p50, "p90": None, "p99": None},
            "ttft_s": {"p50": None, "p90": None, "p99": ttft_p99}, "out_tok_s": out_tok_s, "num_ok": 32}


def test_compare_puts_ours_over_vllms_and_checks_the_goal() -> None:
    ours = {"rates": [_run("1", 0.040, 0.20, 50.0), _run("inf", 0.100, 1.0, 300.0)], "saturation_out_tok_s": 300.0}
    theirs = {"rates": [_run("1", 0.047, 0.27, 48.0), _run("inf", 0.090, 1.2, 226.6)], "saturation_out_tok_s": 226.6}
    result = serving_peer.compare(ours, theirs)
    assert [r["rate"] for r in result["vs_vllm"]] == ["1", "inf"]
    first, second = result["vs_vllm"]
    assert first["tpot_p50_ratio"] == 0.851 and first["ttft_p99_ratio"] == 0.741 and first["no_worse"]
    assert second["tpot_p50_ratio"] == 1.111 and not second["no_worse"]  # slower decode at saturation
    assert result["saturation_ratio_vs_vllm"] == 1.324 and result["goal_saturation_met"]
    assert not result["goal_latency_no_worse_every_rate"]
    ours["rates"][1]["tpot_s"]["p50"] = 0.085
    assert serving_peer.compare(ours, theirs)["goal_latency_no_worse_every_rate"]
    assert vllm_peer.ratio(1.0, 0) is None and vllm_peer.ratio(None, 2.0) is None


def test_openai_stream_body_and_events() -> None:
    body = vllm_client.completion_body("m", RequestSpec("hi there", 7), "rate-inf")
    assert body["cache_salt"] == "rate-inf"  # the same prefix-cache namespace as our side's phase
    assert body["max_tokens"] == 7 and body["ignore_eos"] and body["temperature"] == 0.0 and body["stream"]
    assert body["return_token_ids"] and body["stream_options"] == {"include_usage": True}
    assert vllm_client.parse_event('data: {"choices": [{"token_ids": [5]}]}') == {"choices": [{"token_ids": [5]}]}
    assert vllm_client.parse_event("data: [DONE]") is None and vllm_client.parse_event("") is None
