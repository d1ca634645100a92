"""Stopping the server processes that the launchers start (tritonserver, the kserve ModelServer)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


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


def stop_process_group(proc: subprocess.Popen, sig: signal.Signals, timeout: float, kill_timeout: float,
                       grace: float = 5.0) -> None:
    """stop_process for a child started in a session of its own (Popen's start_new_session, so its
    process group id is its pid), then the rest of that group: the processes it started and left
    running. A server that stops cleanly ends its children itself (tritonserver unloads its models,
    and their Python backend stubs exit); one that crashed or had to be killed cannot, and a stub
    that misses its parent's death would run on. Those get SIGTERM (with SIGCONT, should one be
    stopped) and, if any is left after `grace` seconds, SIGKILL."""
    stop_process(proc, sig, timeout, kill_timeout)
    pgid = proc.pid
    if _signal_group_until_empty(pgid, (signal.SIGTERM, signal.SIGCONT), grace):
        return
    if not _signal_group_until_empty(pgid, (signal.SIGKILL,), kill_timeout):
        raise TimeoutError(f"process group {pgid} still has live processes {kill_timeout:.0f} s after SIGKILL")


def _signal_group_until_empty(pgid: int, signals: tuple[signal.Signals, ...], timeout: float) -> bool:
    """Send `signals` to group `pgid` if it has live processes; whether it has none within `timeout`."""
    if not group_is_alive(pgid):
        return True
    for sig in signals:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
    deadline = time.monotonic() + timeout
    while group_is_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def group_is_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a process that is not a zombie. Zombies do not count: they
    run nothing, and an orphan's is reaped by whoever adopted it (init, a subreaper), not by us."""
    if not os.path.isdir("/proc/self"):  # no /proc: ask the kernel, which counts zombies too
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in os.scandir("/proc"):
        fields = stat_fields(entry.name) if entry.name.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the process's name (state, ppid, process group, ...,
    utime at 11, stime at 12), or None once the process has exited. The name is cut off at its last
    parenthesis: it may hold spaces and parentheses itself."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
