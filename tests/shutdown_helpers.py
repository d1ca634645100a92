"""Stopping real servers as a user does (a signal to `pagedserve triton` / `pagedserve kserve`) and
watching what their clients see: streams that finish, streams cut off with an error, and when the
process exits. Shared by tests/test_triton_shutdown.py and tests/test_kserve_shutdown.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DRAIN_TIMEOUT = 3.0
"""drain_timeout of the test servers: short, so a test waits seconds, yet longer than a short
stream takes (30 tokens at STEP_DELAY) and far shorter than a long one (LONG_TOKENS)."""
STEP_DELAY = 0.03
SHORT_TOKENS = 30
LONG_TOKENS = 2000
"""60 s at STEP_DELAY: a long stream outlasts the drain period many times over."""
MARGIN = 2.0
"""What the issue allows past drain_timeout: every stream has its final response or error, and the
server has exited, within DRAIN_TIMEOUT + MARGIN of the signal."""
IDLE_EXIT_S = 2.0
"""An idle server exits within this of SIGTERM or SIGINT."""


@dataclass
class StreamEnd:
    """How one client's stream ended, seen from the client."""

    name: str
    deltas: int = 0
    final: bool = False
    """A final response that completed the request (data, no error)."""
    error: str | None = None
    ended_at: float | None = None
    """time.monotonic() when the client saw the end (final, error, or the connection closing)."""
    events: list = field(default_factory=list)


def assert_drained_in_time(ends: dict[str, StreamEnd], signalled: float, code: int, exited: float,
                           log: str) -> None:
    """The drain's outcome both servers owe: the long streams (sse-long, grpc-long) end with the
    drain error, every stream ends within DRAIN_TIMEOUT + MARGIN of the signal, and the server
    exits 0 within the same bound."""
    for name in ("sse-long", "grpc-long"):  # cut off when the drain period ended, with an error saying so
        e = ends[name]
        assert e.error is not None and "drain period" in e.error, (name, e, log)
    for e in ends.values():
        assert e.ended_at is not None and e.ended_at - signalled < DRAIN_TIMEOUT + MARGIN, (e.name, e, log)
    assert code == 0, log
    assert exited < DRAIN_TIMEOUT + MARGIN, f"exited {exited:.1f} s after SIGTERM\n{log}"


def tail(log_path: Path, n: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def kill_if_running(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def signal_and_time_exit(proc: subprocess.Popen, sig: signal.Signals, timeout: float = 90.0) -> tuple[int, float]:
    """Send `sig`; (exit status, seconds from the signal to the exit)."""
    signalled = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - signalled


def sse_post(url: str, body: dict) -> socket.socket:
    """POST `body` to an SSE route over a raw socket, as `curl -sN` does; the caller reads the
    events with read_sse_events and closes the socket (closing it early abandons the stream)."""
    host, port, path = _split(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, port), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _split(url: str) -> tuple[str, int, str]:
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    return host, int(port), "/" + path


def read_sse_events(sock: socket.socket, stop_after: int | None = None):
    """Yield each `data:` event's JSON text as it arrives, until the server ends the response (or
    closes the connection) or `stop_after` events were read. Handles chunked encoding loosely: the
    event lines are found wherever the chunks split them."""
    buf = b""
    n = 0
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data: "):
                n += 1
                yield line[len(b"data: "):].decode()
                if stop_after is not None and n >= stop_after:
                    return
            elif line == b"0":  # the last chunk of a chunked response: the stream is over
                if not buf.strip():
                    return
            if line.startswith(b"data: [DONE]"):
                return


def consume_sse(end: StreamEnd, sock: socket.socket, is_error, is_final) -> None:
    """Read an SSE stream to its end into `end` (run on a thread)."""
    try:
        for text in read_sse_events(sock):
            if text == "[DONE]":
                break
            event = json.loads(text)
            end.events.append(event)
            if is_error(event):
                end.error = json.dumps(event)
                break
            end.deltas += 1
            if is_final(event):
                end.final = True
    finally:
        end.ended_at = time.monotonic()
        sock.close()


def start_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def one_thread_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(extra or {})}
