"""Reliability benchmark: what the whole stack survives, measured on real processes.

One stack (memory service, compute service, gateway; ``pagedserve.stack`` via
``pagedserve_testing/stack.py``) serves the default model on the CPU, and the same scenarios as the
``tests/reliability`` suite run at full size:

1. fuzzing: ``--fuzz-cases`` hostile requests per service (gateway, compute, memory), status codes
   tallied; INTERNAL, UNKNOWN and DEADLINE_EXCEEDED count as failures;
2. load: ``--clients`` concurrent streaming clients through the gateway (greedy, EOS ignored),
   TTFT p50/p99, streams lost or answered twice, the gateway's peak of requests held; then an
   overload burst against a gateway with a small queue (RESOURCE_EXHAUSTED, how fast);
3. churn: ``--churn`` mixed requests, open descriptors and threads of every process before and after;
4. faults: a client that opens 100 streams and is SIGKILLed; SIGSTOP/SIGCONT of the compute
   service; SIGKILL of the compute service mid-stream (then restarted: is the prefix cache warm?);
   SIGKILL of the memory service (both recover; no /dev/shm segment left);
5. security: socket and segment modes, no prompt text in any log, cache_salt isolation.

Blocks are checked after every phase: no sequence left, free + cached + used == total.
Prints a table, then as its last line one JSON object. From the repository root:

    python -m benchmarks.bench_reliability                # default model, 10,000 cases, 256 clients
    python -m benchmarks.bench_reliability --quick        # tiny random model, small numbers
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from pagedserve_testing import fuzz, load
from pagedserve_testing.stack import (
    NOT_SERVING, SERVING, Stack, StackConfig, kv_layout, start_gateway, start_stack,
)
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.stack import shm_segments

SECRET = "reliability-secret-prompt-4417"


def _request(prompt: str, max_tokens: int, **fields: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, params=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0), **fields)


def _timed(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    wait_until(predicate, timeout_s, what)
    return round(time.monotonic() - started, 2)


def _stream_fails(stream) -> tuple[str, float]:  # a grpc streaming call
    started = time.monotonic()
    try:
        for _ in stream:
            pass
    except grpc.RpcError as exc:
        return exc.code().name, round(time.monotonic() - started, 2)
    return "OK", round(time.monotonic() - started, 2)


def run_fuzz(stack: Stack, num_cases: int, vocab_size: int) -> dict[str, dict]:
    out = {}
    targets = {
        "gateway": lambda: fuzz.run_cases(stack.gateway.address, fuzz.gateway_cases(num_cases, 11), concurrency=8),
        "compute": lambda: fuzz.run_cases(stack.compute.address, fuzz.compute_cases(num_cases, vocab_size, 12),
                                          concurrency=8),
        "memory": lambda: fuzz.run_memory_fuzz(stack.memory.address,
                                               kv_layout(stack.config.model, stack.config.block_size),
                                               num_cases, 13, concurrency=4),
    }
    for name, run in targets.items():
        started = time.monotonic()
        tally = run()
        stack.wait_idle(60)
        out[name] = {"cases": sum(tally.values()), "codes": dict(sorted(tally.items())),
                     "bad": sum(tally[c] for c in fuzz.BAD_CODES), "serving_after": stack.all_serving(),
                     "seconds": round(time.monotonic() - started, 1)}
        print(f"fuzz {name:8s} {out[name]}", flush=True)
    return out


def run_load(stack: Stack, num_clients: int, max_tokens: int) -> dict:
    ok_metric = 'pagedserve_gateway_requests_total{method="GenerateStream",status="OK"}'
    before_ok = load.metric(stack.gateway.metrics_port, ok_metric)
    peak, done = [0.0], threading.Event()

    def sample() -> None:  # the gateway's own count of requests it holds, sampled during the run
        while not done.wait(0.05):
            peak[0] = max(peak[0], load.metric(stack.gateway.metrics_port, "pagedserve_gateway_queue_length"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    report = load.run_streams(stack.gateway.address, num_clients, max_tokens, timeout_s=900, tag="bench")
    done.set()
    sampler.join()
    answered = load.metric(stack.gateway.metrics_port, ok_metric) - before_ok
    well_formed = report.num_well_formed(max_tokens)
    stack.wait_idle(60)
    return {"clients": num_clients, "max_tokens": max_tokens, "codes": report.codes, "held_peak": int(peak[0]),
            "well_formed": well_formed, "lost": num_clients - well_formed,
            "answered_twice": int(answered) - well_formed,
            **{f"ttft_{k}_ms": v for k, v in report.ttft_percentiles_ms().items()},
            "wall_s": round(report.wall_s, 1),
            "tokens_per_s": round(sum(r.num_tokens for r in report.results) / report.wall_s, 1)}


def run_overload(stack: Stack, queue: int) -> dict:
    small = start_gateway([stack.compute.address], stack.run_dir, "--max-queued-requests", str(queue))
    try:
        report = load.run_streams(small.address, queue * 2, 16, timeout_s=600, tag="over")
    finally:
        small.stop()
    refused = [r.elapsed_s for r in report.results if r.code == "RESOURCE_EXHAUSTED"]
    stack.wait_idle(60)
    return {"queue": queue, "sent": queue * 2, "codes": report.codes,
            "max_refusal_ms": round(max(refused, default=0.0) * 1000, 1)}


def run_churn(stack: Stack, num_requests: int) -> dict:
    load.churn(stack.gateway.address, 200, concurrency=16)  # warm-up: pools and connections at size
    stack.wait_idle(60)
    before, started = stack.resources(), time.monotonic()
    tally = load.churn(stack.gateway.address, num_requests, concurrency=16)
    stack.wait_idle(60)
    return {"requests": num_requests, "codes": tally, "seconds": round(time.monotonic() - started, 1),
            "before": before, "after": stack.resources()}


def run_faults(stack: Stack, num_vanishing: int) -> dict:
    faults: dict[str, dict] = {}
    # Streams that outlast each fault: most of the model's context.
    [model] = stack.gateway.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
    long = min(2000, model.max_model_len - 500)
    client = load.vanishing_client(stack.gateway.address, num_vanishing, long)
    wait_until(lambda: load.metric(stack.gateway.metrics_port, "pagedserve_gateway_queue_length") >= num_vanishing,
               120, "every stream of the vanishing client held")
    client.kill()
    client.wait()
    faults["vanishing_client"] = {"streams": num_vanishing, "reclaimed_s": _timed(
        lambda: stack.memory_stats().num_sequences == 0 and stack.compute_load().num_running == 0, 60, "aborted"),
        "survived": True}  # a timeout above raises instead
    stack.wait_idle(10)

    stack.compute.send_signal(signal.SIGSTOP)
    out_s = _timed(lambda: stack.gateway.num_healthy_backends() == 0, 60, "the hung backend out of rotation")
    stack.compute.send_signal(signal.SIGCONT)
    faults["sigstop_compute"] = {"out_of_rotation_s": out_s, "back_s": _timed(
        lambda: stack.gateway.num_healthy_backends() == 1, 60, "back in rotation"), "survived": True}

    cached_prompt = f"{SECRET}: a prompt whose prefix the memory service keeps across compute restarts. " * 2
    stack.gateway.stub.Generate(_request(cached_prompt, 2), timeout=120)
    stream = stack.gateway.stub.GenerateStream(_request(cached_prompt + " more", long), timeout=600)
    next(stream)
    stack.compute.kill()
    code, failed_s = _stream_fails(stream)
    reclaimed_s = _timed(lambda: stack.memory_stats().num_sequences == 0 and stack.memory_stats().num_clients == 0,
                         60, "the dead client's blocks reclaimed")
    stack.restart_compute()
    wait_until(lambda: stack.gateway.num_healthy_backends() == 1, 60, "the restarted compute in rotation")
    first = time.monotonic()
    again = stack.gateway.stub.Generate(_request(cached_prompt, 2), timeout=300)
    faults["sigkill_compute"] = {"client_code": code, "client_failed_s": failed_s, "blocks_reclaimed_s": reclaimed_s,
                                 "first_request_after_restart_s": round(time.monotonic() - first, 2),
                                 "cached_tokens_after_restart": again.usage.cached_prompt_tokens,
                                 "survived": code == "UNAVAILABLE" and again.usage.cached_prompt_tokens > 0}

    stream = stack.gateway.stub.GenerateStream(_request("in flight when memory dies", long), timeout=600)
    next(stream)
    killed = stack.memory.pid
    stack.memory.kill()
    code, failed_s = _stream_fails(stream)
    not_serving_s = _timed(lambda: stack.compute_health() == NOT_SERVING, 30, "compute NOT_SERVING")
    stack.restart_memory()
    recovered_s = _timed(lambda: stack.compute_health() == SERVING and stack.gateway.num_healthy_backends() == 1,
                         60, "compute and gateway serving again")
    served = stack.gateway.stub.Generate(_request("after the memory restart", 4), timeout=120).usage.completion_tokens
    faults["sigkill_memory"] = {"client_code": code, "client_failed_s": failed_s,
                                "compute_not_serving_s": not_serving_s,
                                "recovered_s": recovered_s, "served_after": served == 4,
                                "segments_left": 0 if _wait_gone(killed) else len(shm_segments(killed))}
    faults["sigkill_memory"]["survived"] = (code == "UNAVAILABLE" and served == 4
                                            and faults["sigkill_memory"]["segments_left"] == 0)
    stack.wait_idle(30)
    return faults


def _wait_gone(pid: int) -> bool:
    try:
        wait_until(lambda: not shm_segments(pid), 15, "segments of the killed memory service gone")
        return True
    except TimeoutError:
        return False


def run_security(stack: Stack) -> dict:
    sockets = [a.removeprefix("unix:") for a in (stack.memory.address, stack.compute.address)]
    segments = [Path("/dev/shm", s) for s in shm_segments(stack.memory.pid)]
    prompt = f"{SECRET} shared prefix for the salt check, long enough for several blocks of tokens. " * 2
    def cached_tokens(salt: str) -> int:
        return stack.gateway.stub.Generate(_request(prompt, 2, cache_salt=salt), timeout=120).usage.cached_prompt_tokens

    cached = {salt: [cached_tokens(salt) for _ in range(2)] for salt in ("tenant-a", "tenant-b")}
    logs = {p.name: SECRET in p.read_text(errors="replace") for p in stack.run_dir.glob("*.log")}
    return {"socket_modes": sorted({oct(stat.S_IMODE(os.stat(s).st_mode)) for s in sockets}),
            "segment_modes": sorted({oct(stat.S_IMODE(os.stat(s).st_mode)) for s in segments}),
            "logs_with_prompt_text": sorted(name for name, found in logs.items() if found), "num_logs": len(logs),
            "salt_cached_tokens": cached, "salt_isolated": cached["tenant-b"][0] == 0 and cached["tenant-a"][1] > 0}


def _start(model: str, directory: Path, name: str, num_clients: int) -> tuple[Stack, int]:
    """A stack serving ``model`` ('tiny' is built here) in ``directory/name``; and the vocabulary size."""
    from compute_service.model.model_config import ModelConfig
    from compute_service.model.model_loader import resolve_model

    if model == "tiny":
        from pagedserve_testing.tiny_model import build_service_model

        model = str(build_service_model(directory / "tiny-model").path)
    vocab_size = ModelConfig.from_dir(resolve_model(model).path, name=model).vocab_size
    run_dir = directory / name
    run_dir.mkdir()
    config = StackConfig(model, max_num_blocks=2048, max_num_seqs=64, compute_max_queued=512,
                         gateway_max_queued=max(512, num_clients + 16))
    started = time.monotonic()
    stack = start_stack(config, run_dir)
    print(f"{name} stack ({model}) up in {time.monotonic() - started:.0f} s: {stack.pids()}", flush=True)
    return stack, vocab_size


def _finish(stack: Stack, result: dict) -> None:
    """Final checks of one stack: nothing held, every block accounted for, clean exits."""
    final = stack.wait_idle(60)
    leaked = sum(p.num_used_blocks for p in final.pools) + final.num_sequences
    result["blocks_leaked"] = result.get("blocks_leaked", 0) + leaked
    result["all_serving"] = result.get("all_serving", True) and stack.all_serving()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default', 'tiny' (random byte-tokenizer Llama) or a directory")
    p.add_argument("--fuzz-model", default="tiny", help="the model of the fuzzing stack (default tiny: validation, "
                                                        "not the model, is under test, and 30,000 cases stay bounded)")
    p.add_argument("--fuzz-cases", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--churn", type=int, default=10_000)
    p.add_argument("--vanishing-streams", type=int, default=100)
    p.add_argument("--phases", default="fuzz,main", help="fuzz (its own stack), main (load, overload, churn, "
                                                         "faults, security), or both")
    p.add_argument("--quick", action="store_true", help="tiny model, 300 cases, 32 clients, 1,000 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.fuzz_cases, args.clients, args.churn, args.vanishing_streams = "tiny", 300, 32, 1000, 40
    result: dict = {"model": args.model, "fuzz_model": args.fuzz_model, "exit_statuses": {}}
    phases = set(args.phases.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-rel-") as name:
        directory = Path(name)
        if "fuzz" in phases:
            stack, vocab_size = _start(args.fuzz_model, directory, "fuzz", 0)
            try:
                result["fuzz"] = run_fuzz(stack, args.fuzz_cases, vocab_size)
                _finish(stack, result)
            finally:
                result["exit_statuses"]["fuzz"] = stack.stop()
            result["fuzz_bad_codes"] = sum(f["bad"] for f in result["fuzz"].values())
        if "main" in phases:
            _run_main(args, directory, result)
    print(f"\n{'phase':10s} figures\n" + "\n".join(f"{k:10s} {v}" for k, v in result.items() if k != "fuzz"))
    print(json.dumps(result, separators=(",", ":")))
    return 0


def _run_main(args: argparse.Namespace, directory: Path, result: dict) -> None:
    """Load, overload, churn, faults and security on one stack serving ``args.model``."""
    stack, _ = _start(args.model, directory, "main", args.clients)
    result["baseline_resources"] = stack.resources()
    try:
        for phase, run in (("load", lambda: run_load(stack, args.clients, args.max_tokens)),
                           ("overload", lambda: run_overload(stack, 32)),
                           ("churn", lambda: run_churn(stack, args.churn)),
                           ("faults", lambda: run_faults(stack, args.vanishing_streams)),
                           ("security", lambda: run_security(stack))):
            result[phase] = run()
            print(f"{phase} {result[phase]}", flush=True)
        _finish(stack, result)
    finally:
        result["exit_statuses"]["main"] = stack.stop()
    result["faults_survived"] = sum(f["survived"] for f in result["faults"].values())

if __name__ == "__main__":
    sys.exit(main())
