"""Ports for the embedded stack's services (tests, benchmarks): free when handed out, away from
the ports the kernel gives outgoing connections, and never the same one twice."""

import socket

import pytest

from tokenbus.infra.devstack import processes
from tokenbus.infra.devstack.processes import free_port


def test_ports_come_from_below_the_outgoing_range_and_never_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(processes.LISTEN_PORTS_FROM <= p < processes._ephemeral_low() for p in ports)


def bind_run(low: int, count: int) -> list[socket.socket] | None:
    """Sockets bound to ``count`` ports in a row from ``low``; None if one of them is in use."""
    bound = []
    for port in range(low, low + count):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            for held in bound:
                held.close()
            return None
        bound.append(sock)
    return bound


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    """Eight ports to draw from, seven of them held by other sockets: the eighth comes out, and
    after it none."""
    low, held = next(((low, run) for low in range(21000, 30000, 8) if (run := bind_run(low, 8))), (0, None))
    if held is None:
        pytest.skip("no eight free ports in a row")
    held.pop().close()  # the one left free
    try:
        monkeypatch.setattr(processes, "LISTEN_PORTS_FROM", low)
        monkeypatch.setattr(processes, "_ephemeral_low", lambda: low + 8)
        monkeypatch.setattr(processes, "_handed_out", set())
        assert free_port() == low + 7
        with pytest.raises(RuntimeError, match="no free port"):
            free_port()
    finally:
        for sock in held:
            sock.close()
