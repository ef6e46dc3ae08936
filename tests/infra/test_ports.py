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


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    """The draw lands on a port another socket holds, then on a free one: the free one comes out.
    A draw that only ever finds ports in use gives up with an error."""
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        probe.bind(("127.0.0.1", 0))
        in_use, free = held.getsockname()[1], probe.getsockname()[1]
        probe.close()  # free again: the port the draw should come back with
        draws = iter([in_use, in_use, free])
        monkeypatch.setattr(processes.random, "randint", lambda low, high: next(draws))
        monkeypatch.setattr(processes, "_handed_out", set())
        assert free_port() == free

        monkeypatch.setattr(processes.random, "randint", lambda low, high: in_use)
        with pytest.raises(RuntimeError, match="no free port"):
            free_port()
