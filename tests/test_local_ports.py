"""free_ports: distinct ports that a server can bind on loopback right after."""

import socket

from tests.harness.local_ports import free_ports


def test_ports_are_distinct_and_bindable():
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # released again: a server started next can take it
