"""Stopping the server processes that the launchers start (tritonserver, the kserve ModelServer)."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, sig: signal.Signals, timeout: float, kill_timeout: float) -> None:
    """Send `sig` (the server's own graceful shutdown) and wait up to `timeout` seconds; SIGKILL
    if it is still running then. A process that already exited is left alone."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=kill_timeout)
