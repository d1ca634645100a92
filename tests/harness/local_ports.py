"""Free loopback ports for the servers that tests and benchmarks start (Triton, KServe)."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports the OS reports free on `host`. Every socket stays bound until all n are
    chosen: closing each before binding the next could hand the same port out twice."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
