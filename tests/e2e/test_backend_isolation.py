"""The compute service in a shared cluster, on real processes: two compute
services that require a service token (one memory service under both), a gateway that has it.

- Only token holders may call: every RPC but health answers UNAUTHENTICATED without the token, and
  the gateway, which sends it, serves requests end to end.
- A client that never reads its stream pins no memory: the stream's buffer stops at its bound (the
  request is paused, the other requests run on), and after the write-stall timeout the request is
  aborted and every block is free again.
- A request that fails on its own (a detokenizer fault injected into one request, inside the real
  process) ends alone: INTERNAL before any token, finish_reason "error" after some; the others
  finish with the reference tokens, the engine is not rebuilt, and the gateway does not retry it.
"""

from __future__ import annotations

import os
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.gateway.v1 import gateway_pb2
from pagedserve_testing.tiny_model import ServiceModel, hf_greedy
from pagedserve.process import ServiceProcess, wait_until
from pagedserve.sockets import free_port
from pagedserve.stack import COMPUTE_SERVICE, compute_process, memory_process, ready, shm_segments
from pagedserve.test_hooks import TEST_HOOKS_ENV, encode_test_hooks
from tests.e2e.conftest import BLOCK_SIZE, Gateway, start_gateway

TOKEN = "test-service-token-7c1e9b2a40d3"
STALL_TIMEOUT_S = 3.0
MAX_STREAM_BUFFER = 4
FAULT_AFTER_3 = "FAULT3"  # prompts ending with these bytes fail in detokenization after 3 tokens
FAULT_AT_ONCE = "FAULT0"  # ... at their first token (before anything streamed)
PROMPT = [40, 97, 109, 32, 97, 32, 116, 105, 110, 121]


@dataclass
class Cluster:
    memory: ServiceProcess
    computes: list[ServiceProcess]
    metrics_ports: list[int]
    gateway: Gateway
    token_file: Path

    def metric(self, name: str, index: int = 0) -> float:
        """One sample of a compute service's Prometheus text (0 when absent... never: fail loudly)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[index]}/metrics", timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.split(" ")[0] in (name, f"{name}_total"):
                    return float(line.split(" ")[1])
        raise AssertionError(f"metric {name} not exported")

    def num_used_blocks(self) -> int:
        from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc

        with grpc.insecure_channel(self.memory.address) as channel:
            stats = memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=5)
        return sum(p.num_used_blocks for p in stats.pools)


def _fault_env(model: ServiceModel) -> dict[str, str]:
    faults = [{"prompt_suffix": model.tokenizer.encode(FAULT_AFTER_3), "after_tokens": 3},
              {"prompt_suffix": model.tokenizer.encode(FAULT_AT_ONCE), "after_tokens": 0}]
    return {**os.environ, TEST_HOOKS_ENV: encode_test_hooks(detokenize_fault=faults)}


@pytest.fixture(scope="module")
def cluster(service_model: ServiceModel, run_dir: Path) -> Iterator[Cluster]:
    token_file = run_dir / "service-token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    socket = run_dir / "iso-memory.sock"
    memory = ready(memory_process(socket, ["--max-num-blocks", "1024", "--block-size", BLOCK_SIZE,
                                           "--log-level", "warning"], log_file=run_dir / "iso-memory.log"), 60)
    computes: list[ServiceProcess] = []
    gateway = None
    ports = [free_port(), free_port()]
    try:
        for i, port in enumerate(ports):
            listen = f"unix:{run_dir / f'iso-compute-{i}.sock'}"
            computes.append(compute_process(service_model.path, socket, listen, [
                "--dtype", "float32", "--block-size", BLOCK_SIZE, "--max-num-seqs", "64", "--metrics-port", port,
                "--auth-token-file", token_file, "--write-stall-timeout-s", STALL_TIMEOUT_S,
                "--max-stream-buffer", MAX_STREAM_BUFFER, "--log-level", "warning",
            ], env=_fault_env(service_model), log_file=run_dir / f"iso-compute-{i}.log"))
        for compute in computes:
            compute.wait_ready(120)
        gateway = start_gateway([c.address for c in computes], run_dir, "--backend-token-file", str(token_file))
        wait_until(lambda: gateway.num_healthy_backends() == 2, what="both backends in rotation")
        yield Cluster(memory, computes, ports, gateway, token_file)
    finally:
        statuses = [gateway.stop()] if gateway else []
        statuses += [c.stop() for c in computes] + [memory.stop()]
    assert statuses == [0] * len(statuses)
    assert not shm_segments(memory.pid)
    log = "".join(p.read_text(errors="replace") for p in run_dir.glob("*.log"))
    assert TOKEN not in log, "the service token reached a log"


def _stub(cluster: Cluster, index: int = 0, token: str | None = TOKEN,
          options: list | None = None) -> tuple[grpc.Channel, compute_pb2_grpc.ComputeStub, list]:
    channel = grpc.insecure_channel(cluster.computes[index].address, options=options or [])
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    return channel, compute_pb2_grpc.ComputeStub(channel), metadata


def _generate(prompt: list[int], **params: object) -> compute_pb2.GenerateRequest:
    return compute_pb2.GenerateRequest(prompt_token_ids=prompt, params=compute_pb2.SamplingParams(
        **{"temperature": 0.0, "ignore_eos": True, **params}))


# --- item 2: only the gateways ---------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "", "wrong-token-0000000000", TOKEN[:-1]],
                         ids=["none", "empty", "wrong", "prefix"])
def test_every_rpc_but_health_needs_the_token(cluster: Cluster, token: str | None) -> None:
    channel, stub, metadata = _stub(cluster, token=token)
    with channel:
        calls = {
            "Generate": lambda: list(stub.Generate(_generate(PROMPT, max_tokens=2), metadata=metadata, timeout=10)),
            "Abort": lambda: stub.Abort(compute_pb2.AbortRequest(request_id="job-1"), metadata=metadata, timeout=10),
            "Load": lambda: stub.Load(compute_pb2.LoadRequest(), metadata=metadata, timeout=10),
            "Info": lambda: stub.Info(compute_pb2.InfoRequest(), metadata=metadata, timeout=10),
            "GetTokenizer": lambda: list(stub.GetTokenizer(compute_pb2.GetTokenizerRequest(), metadata=metadata,
                                                           timeout=10)),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as denied:
                call()
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=COMPUTE_SERVICE),
                                                          timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token
    assert cluster.metric("pagedserve_compute_finished_requests") >= 0  # still serving, nothing ran


def test_the_token_holder_is_served(cluster: Cluster, service_model: ServiceModel) -> None:
    channel, stub, metadata = _stub(cluster)
    with channel:
        assert stub.Load(compute_pb2.LoadRequest(), metadata=metadata, timeout=10).max_queued_requests > 0
        messages = list(stub.Generate(_generate(PROMPT, max_tokens=5), metadata=metadata, timeout=30))
    assert [t for m in messages for t in m.token_ids] == hf_greedy(service_model.hf_model, PROMPT, 5)
    # Through the gateway, which sends the token on every call (both backends are in rotation).
    prompt = "the gateway has the token"
    reply = cluster.gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=gateway_pb2.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True)), timeout=60)
    ids = service_model.tokenizer.encode(prompt)
    assert list(reply.choices[0].token_ids) == hf_greedy(service_model.hf_model, ids, 6)


# --- item 3: a client that never reads -------------------------------------------------------


def test_a_never_read_stream_stays_at_its_bound_then_is_aborted(cluster: Cluster, service_model: ServiceModel) -> None:
    """n=32 completions with 20 logprobs each, never read: the transport's windows fill, then the
    stream's buffer, which stops at MAX_STREAM_BUFFER step outputs (the request is paused, holding
    its blocks) while another request runs to completion; after the write-stall timeout the
    request is aborted and every block is free again."""
    # A client that takes nothing: no BDP probing (its window would grow), a small read window.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    channel, stub, metadata = _stub(cluster, options=options)
    stalled_before = cluster.metric("pagedserve_compute_stalled_streams")
    with channel:
        stalled = stub.Generate(_generate(PROMPT, max_tokens=400, n=32, logprobs=20), metadata=metadata, timeout=120)
        wait_until(lambda: cluster.metric("pagedserve_compute_streams_paused") == 1, timeout_s=60,
                   what="the never-read stream's buffer to fill")
        assert cluster.metric("pagedserve_compute_stream_buffered_outputs") == MAX_STREAM_BUFFER
        steps = cluster.metric("pagedserve_compute_steps")
        # Another request meanwhile: served as usual (token for token), while the buffer stays put.
        _, other, _ = _stub(cluster)
        messages = list(other.Generate(_generate(PROMPT[:6], max_tokens=8), metadata=metadata, timeout=60))
        assert [t for m in messages for t in m.token_ids] == hf_greedy(service_model.hf_model, PROMPT[:6], 8)
        assert cluster.metric("pagedserve_compute_steps") >= steps + 8
        assert cluster.metric("pagedserve_compute_stream_buffered_outputs") == MAX_STREAM_BUFFER
        assert cluster.metric("pagedserve_compute_streams_paused") == 1
        # The write-stall timeout: aborted, blocks freed, the stream gone.
        wait_until(lambda: cluster.metric("pagedserve_compute_stalled_streams") == stalled_before + 1,
                   timeout_s=60, what="the stalled stream to be aborted")
        wait_until(lambda: cluster.num_used_blocks() == 0, timeout_s=10, what="its blocks to be freed")
        assert cluster.metric("pagedserve_compute_streams") == 0
        assert cluster.metric("pagedserve_compute_stream_buffered_outputs") == 0
        stalled.cancel()


# --- item 10: one failing request ------------------------------------------------------------


def test_a_request_that_fails_ends_alone(cluster: Cluster, service_model: ServiceModel) -> None:
    channel, stub, metadata = _stub(cluster)
    failed_before = cluster.metric("pagedserve_compute_failed_requests")
    finished_before = cluster.metric("pagedserve_compute_finished_requests")
    poison = PROMPT + service_model.tokenizer.encode(FAULT_AFTER_3)
    results: dict[str, object] = {}

    def run(name: str, prompt: list[int]) -> None:
        try:
            results[name] = list(stub.Generate(_generate(prompt, max_tokens=40), metadata=metadata, timeout=60))
        except grpc.RpcError as exc:
            results[name] = exc

    with channel:
        threads = [threading.Thread(target=run, args=(name, prompt))
                   for name, prompt in (("good-1", PROMPT), ("poison", poison), ("good-2", PROMPT[:7]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        # Before any token: a plain INTERNAL with a message, and the others still run.
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Generate(_generate(PROMPT + service_model.tokenizer.encode(FAULT_AT_ONCE), max_tokens=40),
                               metadata=metadata, timeout=60))
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "detokeniz" in failed.value.details() or "postprocessing failed" in failed.value.details()
    poisoned = results["poison"]
    assert isinstance(poisoned, list), poisoned
    assert [len(m.token_ids) for m in poisoned[:3]] == [1, 1, 1]  # three tokens streamed, then the end
    assert poisoned[-1].finish_reason == "error" and poisoned[-1].HasField("usage")
    assert [m.finish_reason for m in poisoned[:-1]] == [""] * (len(poisoned) - 1)
    for name, prompt in (("good-1", PROMPT), ("good-2", PROMPT[:7])):
        messages = results[name]
        assert isinstance(messages, list), (name, messages)
        assert [t for m in messages for t in m.token_ids] == hf_greedy(service_model.hf_model, prompt, 40)
        assert messages[-1].finish_reason == "length"
    assert cluster.metric("pagedserve_compute_failed_requests") == failed_before + 2
    assert cluster.metric("pagedserve_compute_finished_requests") == finished_before + 4
    assert cluster.metric("pagedserve_compute_ready") == 1  # never NOT_SERVING: the engine was not rebuilt
    wait_until(lambda: cluster.num_used_blocks() == 0, timeout_s=10, what="the blocks to be freed")


def test_the_gateway_does_not_retry_a_failed_request(cluster: Cluster) -> None:
    """A request that fails on its own reaches the client as INTERNAL from the one backend that ran
    it (retrying it elsewhere would only fail it there too); once tokens streamed, as
    finish_reason "error"."""
    def failed_total() -> float:
        return sum(cluster.metric("pagedserve_compute_failed_requests", i) for i in range(2))

    before = failed_total()
    params = gateway_pb2.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as failed:
        cluster.gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt="poison " + FAULT_AT_ONCE, params=params),
                                      timeout=60)
    assert failed.value.code() == grpc.StatusCode.INTERNAL, failed.value.details()
    assert failed_total() == before + 1  # one backend ran it: no retry
    chunks = list(cluster.gateway.stub.GenerateStream(
        gateway_pb2.GenerateRequest(prompt="poison " + FAULT_AFTER_3, params=params), timeout=60))
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["error"]
    assert failed_total() == before + 2
    reply = cluster.gateway.stub.Generate(gateway_pb2.GenerateRequest(prompt="fine", params=params), timeout=60)
    assert reply.choices[0].finish_reason == "length" and len(reply.choices[0].token_ids) == 20
