"""The memory service's graceful drain, on real processes (a memory and a compute service).

SIGTERM: NOT_SERVING at once, a new Attach refused with UNAVAILABLE naming the shutdown, the compute
service's request in flight still served (its Steps answered) to its last token, then the service
exits, within ``--drain-timeout-s`` + ``drain.MEMORY_STOP_S``, leaving neither its socket nor its
shared-memory segment. An idle client (attached, no request) is not waited for.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.drain import MEMORY_STOP_S
from pagedserve.memory.v1 import memory_pb2 as mpb
from pagedserve.memory.v1 import memory_pb2_grpc
from pagedserve.process import check_health, wait_until
from pagedserve.stack import shm_segments
from pagedserve_testing.tiny_model import ServiceModel
from tests.compute_service.service_fixtures import running_services

PROMPT = [40, 97, 109, 32, 97, 32, 116, 105, 110, 121]
DRAIN_S = 20
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MEMORY_ARGS = ("--max-num-blocks", "2048", "--drain-timeout-s", str(DRAIN_S))


def _attach(socket: Path) -> grpc.RpcError:
    layout = mpb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=16)
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            memory_pb2_grpc.MemoryManagerStub(channel).Attach(mpb.AttachRequest(client_name="late", layout=layout),
                                                              timeout=10)
    return refused.value


def test_sigterm_refuses_attach_serves_the_request_in_flight_and_exits_within_the_bound(
        service_model: ServiceModel) -> None:
    with running_services(service_model.path, memory_args=MEMORY_ARGS,
                          compute_args=("--num-speculative-tokens", "0")) as services:
        memory, socket = services.memory, services.memory_socket
        stream = services.stub.Generate(cpb.GenerateRequest(
            prompt_token_ids=PROMPT, params=cpb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)),
            timeout=120)
        read = [next(stream)]
        assert services.stub.Load(cpb.LoadRequest(), timeout=10).num_running == 1  # in flight at the signal
        sigterm_at = time.monotonic()
        memory.send_signal(signal.SIGTERM)
        wait_until(lambda: check_health(f"unix:{socket}") == NOT_SERVING, 5, "the memory service NOT_SERVING")
        not_serving_at = time.monotonic()
        refused = _attach(socket)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
        read += list(stream)  # every Step of the request in flight is still answered
        done_at = time.monotonic()
        status = memory.proc.wait(timeout=DRAIN_S + MEMORY_STOP_S + 30)
        exited_at = time.monotonic()
        assert status == 0
        assert sum(len(m.token_ids) for m in read) == 400
        assert read[-1].finish_reason == "length"
        assert not_serving_at < done_at  # readiness failed while the request still ran
        print(f"memory drain: NOT_SERVING {not_serving_at - sigterm_at:.2f} s, request done "
              f"{done_at - sigterm_at:.2f} s, exited {exited_at - sigterm_at:.2f} s after SIGTERM "
              f"(bound {DRAIN_S + MEMORY_STOP_S} s)")
        assert exited_at - sigterm_at <= DRAIN_S + MEMORY_STOP_S
        assert not Path(socket).exists()
        assert shm_segments(memory.pid) == []


def test_an_idle_client_is_not_waited_for(service_model: ServiceModel) -> None:
    """The compute service stays attached, with nothing in flight: the memory service stops at once
    (it detaches only when it stops itself, so waiting for it would only delay the exit)."""
    with running_services(service_model.path, memory_args=MEMORY_ARGS) as services:
        sigterm_at = time.monotonic()
        services.memory.send_signal(signal.SIGTERM)
        assert services.memory.proc.wait(timeout=DRAIN_S + MEMORY_STOP_S + 30) == 0
        exited_s = time.monotonic() - sigterm_at
        print(f"memory drain, idle client: exited {exited_s:.2f} s after SIGTERM")
        assert exited_s < MEMORY_STOP_S
        assert shm_segments(services.memory.pid) == []
