"""The vLLM peer's parts that run without vLLM: arguments, environment, the side-by-side report.
No test installs or starts vLLM; the peer runs only from the benchmarks' command lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_serving, bench_throughput, vllm_peer
from benchmarks.serving import vllm_bench, vllm_client
from benchmarks.serving import peer as serving_peer
from benchmarks.serving.workload import RequestSpec
from benchmarks.throughput import peer as throughput_peer
from benchmarks.throughput.workload import Request


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
    args = bench_throughput.parse_args(["--peer", "vllm", "--device", "cpu", "--max-num-batched-tokens", "4096",
                                        "--workload", "random"])
    assert args.kv_cache_bytes == 1 << 30 and args.baselines == []
    assert args.vllm_budgets == [(256, 4096, 0), (256, 4096, 2)]  # ours, with and without n-gram drafts
    # The realistic workload is the default and samples: no drafts on either side; vLLM at our dtype
    # unless told, or at both to find its best.
    args = bench_throughput.parse_args(["--peer", "vllm", "--device", "cpu", "--dtype", "float32"])
    assert args.workload == "realistic" and args.vllm_budgets == [(256, 2048, 0)] and args.vllm_dtypes == ["float32"]
    args = bench_throughput.parse_args(["--peer", "vllm", "--device", "cpu", "--vllm-dtypes", "bfloat16,float32"])
    assert args.vllm_dtypes == ["bfloat16", "float32"]
    with pytest.raises(SystemExit):
        bench_throughput.parse_args(["--peer", "vllm", "--device", "cpu", "--vllm-dtypes", "int8"])
    assert bench_throughput.parse_args(["--random-model-config", "tiny", "--device", "cpu"]).workload == "random"
    with pytest.raises(SystemExit):  # a random-weight model has no tokenizer for English prompts
        bench_throughput.parse_args(["--random-model-config", "tiny", "--workload", "realistic"])
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
    args = bench_serving.parse_args(["--peer", "vllm", "--dtype", "float32"])
    assert args.vllm_dtype == "float32" and args.workload == "realistic"  # vLLM at our dtype unless told
    assert bench_serving.parse_args(["--peer", "vllm", "--vllm-dtype", "bfloat16"]).vllm_dtype == "bfloat16"
    # vLLM's client: the issue's phases by default (8 one at a time, 64 at 0.5 req/s and all at once).
    args = bench_serving.parse_args(["--client", "vllm-bench", "--peer", "vllm"])
    assert (args.rates, args.num_requests, args.baseline_requests) == ([0.5, float("inf")], 64, 8)
    assert [(p.label, p.num_prompts, p.max_concurrency) for p in vllm_bench.phases(args)] == [
        ("one_at_a_time", 8, 1), ("rate-0.5", 64, None), ("rate-inf", 64, None)]
    assert len({p.seed for p in vllm_bench.phases(args)}) == 3  # each phase its own prompts
    for bad in (["--workload", "random"], ["--api", "openai"], ["--vllm-dtype", "int8", "--peer", "vllm"]):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(["--client", "vllm-bench", *bad])


def test_vllm_bench_serve_command_line() -> None:
    phase = vllm_bench.Phase("rate-0.5", 64, 0.5, None, 4)
    args = vllm_bench.client_args("http://127.0.0.1:9", Path("/m"), "served", Path("d.jsonl"), phase)
    assert "--ignore-eos" in args  # every request generates exactly its output_tokens
    assert args[args.index("--request-rate") + 1] == "0.5" and args[args.index("--seed") + 1] == "4"
    assert args[args.index("--dataset-name") + 1] == "custom" and args[args.index("--custom-output-len") + 1] == "-1"
    assert args[args.index("--temperature") + 1] == "0.8" and args[args.index("--top-p") + 1] == "0.95"
    assert args[args.index("--served-model-name") + 1] == "served" and "--max-concurrency" not in args
    one = vllm_bench.client_args("u", Path("/m"), "s", Path("d"), vllm_bench.Phase("one_at_a_time", 8, float("inf"),
                                                                                   1, 0))
    assert one[one.index("--request-rate") + 1] == "inf" and one[one.index("--max-concurrency") + 1] == "1"


def test_vllm_bench_result_block_summary_and_ratios() -> None:
    stdout = "noise\n" + "=" * 16 + " Serving Benchmark Result " + "=" * 16 + "\nSuccessful requests: 8\n" + \
        "=" * 50 + "\nafter\n"
    assert vllm_bench.result_block(stdout).splitlines()[1:] == ["Successful requests: 8", "=" * 50]
    assert vllm_bench.result_block("no block") == ""

    def result(out_tok_s: float, ttft_ms: float, tpot_ms: float) -> dict:
        r = {"completed": 8, "failed": 0, "duration": 10.0, "request_throughput": 0.8, "output_throughput": out_tok_s,
             "total_output_tokens": 800, "total_input_tokens": 4000}
        for metric, ms in (("ttft", ttft_ms), ("tpot", tpot_ms), ("itl", tpot_ms), ("e2el", 1000.0)):
            r |= {f"mean_{metric}_ms": ms, **{f"p{q}_{metric}_ms": ms for q in ("50", "90", "99")}}
        return r

    ours = vllm_bench.summarise(result(240.0, 500.0, 40.0))
    assert ours["ttft_s"]["p99"] == 0.5 and ours["tpot_s"]["p50"] == 0.04 and ours["out_tok_s"] == 240.0
    theirs = vllm_bench.summarise(result(200.0, 400.0, 50.0))
    comparison = vllm_bench.compare({"phases": {"rate-inf": ours, "rate-0.5": ours, "one_at_a_time": ours}},
                                    {"phases": {"rate-inf": theirs, "rate-0.5": theirs, "one_at_a_time": theirs}})
    assert comparison["vs_vllm"]["rate-inf"] == {"out_tok_s_ratio": 1.2, "ttft_p50_ratio": 1.25,
                                                 "ttft_p99_ratio": 1.25, "tpot_p50_ratio": 0.8}
    assert comparison["goals"] == {"saturation_ratio": 1.2, "saturation_goal_met": False,  # the goal is 1.5x
                                   "rate-0.5_latency_no_worse": False,  # TTFT p99 1.25x vLLM's
                                   "one_at_a_time_tpot_no_worse": True,  # 0.8x: no worse, but not 0.7x
                                   "one_at_a_time_tpot_goal_met": False, "one_at_a_time_ttft_no_worse": False}
    faster = vllm_bench.compare({"phases": {"rate-inf": vllm_bench.summarise(result(300.0, 300.0, 30.0)),
                                            "one_at_a_time": vllm_bench.summarise(result(300.0, 300.0, 30.0))}},
                                {"phases": {"rate-inf": theirs, "one_at_a_time": theirs}})
    assert faster["goals"] == {"saturation_ratio": 1.5, "saturation_goal_met": True,
                               "one_at_a_time_tpot_no_worse": True, "one_at_a_time_tpot_goal_met": True,
                               "one_at_a_time_ttft_no_worse": True}


def test_offline_job_carries_each_requests_sampling() -> None:
    workload = [Request([5, 6], 3), Request([7], 4, temperature=0.8, top_p=0.95)]
    job = throughput_peer.offline_job(Path("/m"), workload, "bfloat16", 0, (256, 2048, 0))
    assert job["requests"] == [[[5, 6], 3, 0.0, 1.0], [[7], 4, 0.8, 0.95]] and job["dtype"] == "bfloat16"
    assert "seed" not in str(job["requests"])  # no per-request seed (vLLM 0.32's CPU build fails on them)


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
    assert result["saturation_ratio_vs_vllm"] == 1.324 and not result["goal_saturation_met"]  # 1.5x asked
    assert not result["goal_latency_no_worse_every_rate"]
    ours["rates"][1]["tpot_s"]["p50"] = 0.085
    assert serving_peer.compare(ours, theirs)["goal_latency_no_worse_every_rate"]
    assert vllm_peer.ratio(1.0, 0) is None and vllm_peer.ratio(None, 2.0) is None


def test_openai_stream_body_and_events() -> None:
    body = vllm_client.completion_body("m", RequestSpec("hi there", 7), "rate-inf")
    assert body["cache_salt"] == "rate-inf"  # the same prefix-cache namespace as our side's phase
    assert body["max_tokens"] == 7 and body["ignore_eos"] and body["temperature"] == 0.0 and body["stream"]
    sampled = vllm_client.completion_body("m", RequestSpec("hi", 7, temperature=0.8, top_p=0.95), "rate-inf")
    assert (sampled["temperature"], sampled["top_p"]) == (0.8, 0.95) and "seed" not in sampled
    assert body["return_token_ids"] and body["stream_options"] == {"include_usage": True}
    assert vllm_client.parse_event('data: {"choices": [{"token_ids": [5]}]}') == {"choices": [{"token_ids": [5]}]}
    assert vllm_client.parse_event("data: [DONE]") is None and vllm_client.parse_event("") is None
