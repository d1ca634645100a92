"""Whether tritonserver has begun to shut down, told by the launcher's notice or by its listening
ports, without asking Triton.

A Python model hears of a shutdown only in finalize(), and Triton calls that only once every
response factory is released, that is after the streams in flight have ended: to give them
drain_timeout and end the rest, the model must notice the shutdown itself. Asking Triton is unsafe
then: pb_utils.is_model_ready() fails ("Server not ready") on a server that is starting or
stopping, and on that path the Python backend's stub (Triton 2.51) reads the error message from
shared memory after tritonserver may already have freed it. Now and then the stub segfaults and
tritonserver aborts (boost::interprocess::lock_exception), ending every open stream without a
final response (hammering the failing call at shutdown crashed 3 servers of 5 here; a million
calls that succeed crashed none).

What Triton does show: on SIGTERM or SIGINT it closes its HTTP port once the open HTTP connections
are done, the moment it stops being ready (its gRPC and metrics ports close only at exit). The
stub's parent is tritonserver, so /proc says when a port it listened on is gone.

That comes too late while an HTTP stream is open: Triton 2.51 (server src/http_server.cc,
HTTPServer::Stop) first refuses new connections, then waits, in steps of 1 s, until no HTTP
connection is left or its exit timeout is spent, and only then closes the port. A long SSE stream
keeps its connection until it ends, so the model would start draining only when the exit timeout
(30 s) was over and Triton exited under it: every stream still open, gRPC ones too, was cut off
without a final response. So `pagedserve triton` (launcher.py), which receives the signal, first
creates a notice file named by SHUTDOWN_NOTICE_ENV and then passes the signal on; the model looks
for that file every 0.1 s (a stat) and starts draining within that. The ports remain the watch for
a tritonserver started some other way.
"""

from __future__ import annotations

import os
import threading

TCP_LISTEN = "0A"
"""The `st` column of /proc/<pid>/net/tcp{,6} for a socket in LISTEN state."""


def listening_ports(pid: int) -> dict[str, int] | None:
    """fd -> socket inode, for each TCP socket (IPv4 or IPv6) process `pid` listens on; None where
    /proc cannot tell (not Linux, or no permission). A few ms: the kernel walks its socket tables."""
    try:
        sockets = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # closed since the listing
                continue
            if target.startswith("socket:["):
                sockets[int(target[len("socket:["):-1])] = fd
        listening = {}
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}") as f:
                    next(f)  # the header
                    for line in f:
                        fields = line.split()
                        inode = int(fields[9])
                        if fields[3] == TCP_LISTEN and inode in sockets:
                            listening[sockets[inode]] = inode
            except FileNotFoundError:  # a kernel without IPv6
                continue
        return listening
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def still_open(pid: int, ports: dict[str, int]) -> bool | None:
    """Whether each fd of `ports` still holds its socket (tens of µs: no socket tables); None where
    /proc cannot tell."""
    for fd, inode in ports.items():
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != f"socket:[{inode}]":
                return False  # the fd now holds something else
        except FileNotFoundError:  # closed (or the server is gone)
            return False
        except OSError:
            return None
    return True


def explicit_model_control(pid: int) -> bool | None:
    """Whether tritonserver `pid` runs in explicit model-control mode (`--model-control-mode
    explicit`, as `pagedserve triton` starts it), read from its command line; None where /proc
    cannot tell. Only then may a model unload itself: otherwise pb_utils.unload_model fails, and a
    failing call to Triton is the stub's unsafe path (above)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    mode = None
    for i, arg in enumerate(args):  # the last occurrence wins, as in Triton's option parsing
        if arg.startswith("--model-control-mode="):
            mode = arg.split("=", 1)[1]
        elif arg == "--model-control-mode" and i + 1 < len(args):
            mode = args[i + 1]
    return mode == "explicit"


class ServerShutdownWatch:
    """Says whether the server process `pid` has closed a port it listened on while serving, and
    whether the launcher's shutdown notice (`notice`, a path) exists.

    Triton opens its ports only once its startup models have loaded, all within a few tens of ms:
    the ports are looked up in the socket tables until two looks find the same ones, and from then
    on only their fds are checked."""

    def __init__(self, pid: int, notice: str | None = None) -> None:
        self.pid = pid
        self.notice = notice
        self._ports: dict[str, int] = {}
        self._settled = False
        self._lock = threading.Lock()  # the model looks from its loop thread and from execute()

    def noticed(self) -> bool:
        """Whether the launcher has announced a shutdown (a stat: a few µs)."""
        return self.notice is not None and os.path.exists(self.notice)

    def shutting_down(self) -> bool | None:
        """True once a port seen open is gone; None where /proc cannot tell."""
        with self._lock:
            if self._settled:
                open_ = still_open(self.pid, self._ports)
                return None if open_ is None else not open_
            now = listening_ports(self.pid)
            if now is None:
                return None
            if self._ports.items() - now.items():
                return True
            self._settled = bool(now) and now == self._ports
            self._ports = now  # nothing seen is gone: `now` holds every port seen
            return False
