"""free_port: ports for a child's --listen come from below the kernel's ephemeral range, where no
outgoing connection can take them between the probe and the child's bind."""

from __future__ import annotations

import socket

from pagedserve import sockets


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    high = sockets._ephemeral_low()
    ports = {sockets.free_port() for _ in range(50)}
    assert all(max(1024, high - 16384) <= port < high for port in ports), ports
    assert len(ports) > 40  # drawn at random, not handed out in order
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))


def test_free_port_skips_a_port_in_use(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])
        monkeypatch.setattr(sockets.random, "randrange", lambda low, high: next(draws))
        assert sockets.free_port() != busy
