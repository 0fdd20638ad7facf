"""free_port: ports for a child's --listen come from below the kernel's ephemeral range, where no
outgoing connection can take them between the probe and the child's bind."""

from __future__ import annotations

import socket

import pytest

from pagedserve import sockets


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    high = sockets._ephemeral_low()
    ports = {sockets.free_port() for _ in range(50)}
    assert all(max(1024, high - 16384) <= port < high for port in ports), ports
    assert len(ports) > 40  # drawn at random, not handed out in order
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))


def test_free_port_skips_a_port_in_use(monkeypatch) -> None:
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()  # free again
        draws = iter([busy, busy, free])
        monkeypatch.setattr(sockets.random, "randrange", lambda low, high: next(draws))
        assert sockets.free_port() == free


def test_free_port_without_room_below_the_range_asks_the_kernel(monkeypatch) -> None:
    monkeypatch.setattr(sockets, "_ephemeral_low", lambda: 1024)  # "1024 65535": nothing below
    monkeypatch.setattr(sockets.random, "randrange", lambda low, high: pytest.fail("drew from an empty range"))
    with socket.socket() as server:
        server.bind(("127.0.0.1", sockets.free_port()))
