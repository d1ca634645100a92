"""Waiting for a server child to answer: the one poll loop every launcher in the tests and
benchmarks uses (kserve, the vLLM router, `pagedserve triton`, an installed wheel's server)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_until_ready(proc: subprocess.Popen, url: str, what: str, log_tail: Callable[[], str],
                     timeout: float, interval: float = 0.25) -> None:
    """Returns once GET `url` answers 200. Raises RuntimeError naming `what`, with the tail of its
    log, if the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready after {timeout:.0f} s:\n{log_tail()}")
        time.sleep(interval)
