"""A compute service's graceful drain, on real processes: SIGTERM with two streams in flight.

Readiness fails first (a health Watch sees NOT_SERVING while the streams are still open), a request
after the signal is refused, the stream whose client reads goes on to its last token, the one whose
client reads nothing (its request paused on its full buffer) is cut when ``--shutdown-grace-s``
ends, and the process has exited within the bound the chart's grace period is derived from
(``shutdown_grace_s + drain.COMPUTE_STOP_S``), its lease released.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve.compute.v1 import compute_pb2_grpc
from pagedserve.drain import COMPUTE_STOP_S
from pagedserve.process import wait_until
from pagedserve.stack import COMPUTE_SERVICE
from pagedserve_testing.tiny_model import ServiceModel
from tests.compute_service.service_fixtures import running_services

PROMPT = [40, 97, 109, 32, 97, 32, 116, 105, 110, 121]
GRACE_S = 4
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _stream(address: str, max_tokens: int) -> tuple[grpc.Channel, grpc.Future]:
    """A stream of 8 completions with 20 logprobs a token on a channel of its own without BDP probing:
    HTTP/2's 64 KiB window holds a few hundred of its messages, so while its client reads nothing its
    request is paused on its full buffer (service/stream_buffer.py), still in flight."""
    channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    call = compute_pb2_grpc.ComputeStub(channel).Generate(cpb.GenerateRequest(
        prompt_token_ids=PROMPT, params=cpb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                           logprobs=20, n=8)), timeout=60)
    return channel, call


def _watch_health(channel: grpc.Channel, changes: list[tuple[int, float]]) -> None:
    """Record each health status of the compute service with when it came, until the server stops."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=COMPUTE_SERVICE))
    try:
        for message in watch:
            changes.append((message.status, time.monotonic()))
    except grpc.RpcError as exc:  # the server's stop ends the stream
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc


def test_sigterm_fails_readiness_first_finishes_in_flight_and_exits_within_the_bound(
        service_model: ServiceModel) -> None:
    with running_services(service_model.path, memory_args=("--max-num-blocks", "2048"),
                          compute_args=("--shutdown-grace-s", str(GRACE_S),
                                        "--num-speculative-tokens", "0")) as services:
        health_changes: list[tuple[int, float]] = []
        watcher = threading.Thread(target=_watch_health, args=(services.channel, health_changes))
        watcher.start()
        # Two requests in flight, both paused on their clients: one that will read everything after
        # the signal, one that never reads again and so cannot end by itself.
        reading_channel, reading = _stream(services.compute.address, 150)
        stalled_channel, stalled = _stream(services.compute.address, 400)
        read = [next(reading)]
        next(stalled)
        wait_until(lambda: services.stub.Load(cpb.LoadRequest()).num_running == 2, 10, "both requests running",
                   interval_s=0.01)

        sigterm_at = time.monotonic()
        services.compute.send_signal(signal.SIGTERM)
        # A new request is refused at once, naming the shutdown.
        with pytest.raises(grpc.RpcError) as refused:
            services.generate(PROMPT, max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        read += list(reading)  # the stream in flight runs to its end, within the grace
        read_done = time.monotonic()
        status = services.compute.proc.wait(timeout=GRACE_S + COMPUTE_STOP_S + 30)
        exited_at = time.monotonic()
        watcher.join(timeout=10)

        assert status == 0
        # Readiness failed first, while both requests were in flight.
        [not_serving_at] = [t for s, t in health_changes if s == NOT_SERVING]
        assert sigterm_at < not_serving_at < read_done
        # The reading stream finished whole: 8 completions of 150 tokens.
        tokens = {i: sum(len(m.token_ids) for m in read if m.index == i) for i in range(8)}
        assert tokens == dict.fromkeys(range(8), 150)
        assert sorted(m.index for m in read if m.finish_reason) == list(range(8))
        assert {m.finish_reason for m in read if m.finish_reason} == {"length"}
        assert read[-1].usage.completion_tokens == 8 * 150
        # The stalled one was cut when the grace ended, not before: what it buffered, then the server's
        # stop; the process exited within the bound that the chart's grace period is derived from.
        with pytest.raises(grpc.RpcError) as cut:
            list(stalled)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        print(f"drain: exited {exited_at - sigterm_at:.2f} s after SIGTERM (grace {GRACE_S} s, bound "
              f"{GRACE_S + COMPUTE_STOP_S} s)")
        assert GRACE_S <= exited_at - sigterm_at <= GRACE_S + COMPUTE_STOP_S
        reading_channel.close()
        stalled_channel.close()
        stats = services.memory_stats()
        assert (stats.num_clients, stats.num_sequences) == (0, 0)  # its lease was released
