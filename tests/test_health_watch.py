"""Health Watch streams of the asyncio servers: capped per connection, a watcher
that stops reading never blocks the server's own status changes, and a cancel that meets a blocked
write is one debug line, not a traceback. An in-process grpc.aio server from pagedserve.rpc."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from pagedserve import rpc
from pagedserve.health import MAX_WATCHES_PER_PEER
from pagedserve.process import async_wait_until

# A client window of about 1 KiB: a watcher that does not read blocks the server's writes quickly.
_SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


async def _server() -> tuple[grpc.aio.Server, rpc.AioHealth, str]:
    server, health = rpc.create_aio_server([], ["demo.Service"], serving=True)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, health, f"127.0.0.1:{port}"


def test_watch_streams_are_capped_per_connection() -> None:
    async def scenario() -> None:
        server, health, address = await _server()
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            calls = [stub.Watch(health_pb2.HealthCheckRequest(service="demo.Service"))
                     for _ in range(MAX_WATCHES_PER_PEER)]
            for call in calls:
                assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            extra = stub.Watch(health_pb2.HealthCheckRequest(service="demo.Service"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await extra.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"at most {MAX_WATCHES_PER_PEER} health Watch streams per connection" in info.value.details()
            calls[0].cancel()
            await async_wait_until(lambda: health.servicer.num_watches == MAX_WATCHES_PER_PEER - 1,
                                   what="the server to end the cancelled watch")
            again = stub.Watch(health_pb2.HealthCheckRequest(service="demo.Service"))
            assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
            # Check stays open whatever the watches.
            reply = await stub.Check(health_pb2.HealthCheckRequest(service="demo.Service"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for call in [*calls, again]:
                call.cancel()
        await server.stop(0)

    asyncio.run(scenario())


def test_a_watcher_that_stops_reading_blocks_no_status_change_and_its_cancel_logs_no_traceback() -> None:
    async def scenario() -> list[dict]:
        server, health, address = await _server()
        channel = grpc.aio.insecure_channel(address, options=_SMALL_WINDOW)
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="demo.Service"))
        await call.read()
        with capture_logs() as logs:
            # Hundreds of changes, each written to a watcher that reads none: its window fills and
            # its write blocks. The reference servicer held its lock while writing, so set() hung.
            for i in range(400):
                await asyncio.wait_for(health.set_serving(i % 2 == 1), timeout=10)
                await asyncio.sleep(0)
            call.cancel()
            # The server notices the cancel while its write is blocked, and the handler ends.
            await async_wait_until(lambda: health.servicer.num_watches == 0, what="the server to end the watch")
        await channel.close()
        await server.stop(0)
        return logs

    logs = asyncio.run(scenario())
    assert not [e for e in logs if e["log_level"] in ("error", "warning")], logs
    # The cancel reaches the handler as a failed write (one debug line) or as a task cancel (none).
    assert [e["log_level"] for e in logs if e["event"] == "health_watch_cancelled_during_write"] in ([], ["debug"])
