"""stop_process: the graceful signal first, SIGKILL only for a child that ignores it.
stop_process_group: the same, and then whatever the child left running in its process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve.adapters.child_process import group_is_alive, stop_process, stop_process_group


def child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"import signal, sys, time\n{code}\nprint('up', flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"  # its handlers are installed before we signal
    return proc


def test_a_child_that_honours_the_signal_exits_with_it():
    proc = child("signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))")
    stop_process(proc, signal.SIGTERM, timeout=10, kill_timeout=5)
    assert proc.returncode == 3


def test_a_child_that_ignores_the_signal_is_killed():
    proc = child("signal.signal(signal.SIGINT, signal.SIG_IGN)")
    stop_process(proc, signal.SIGINT, timeout=0.5, kill_timeout=5)
    assert proc.returncode == -signal.SIGKILL


def test_an_exited_child_is_left_alone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stop_process(proc, signal.SIGTERM, timeout=1, kill_timeout=1)
    assert proc.returncode == 0


# A leader in a session of its own (as the Triton launcher starts tritonserver) that starts a child
# and, on SIGINT, exits without ending it: a server that leaves a Python backend stub behind.
LEADER = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1] + "\\nprint('up', flush=True)\\ntime.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "up"
if sys.argv[2] == "stop":  # a child that cannot act on anything: stopped, as a hung stub would be
    os.kill(child.pid, signal.SIGSTOP)
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
print(child.pid, flush=True)
time.sleep(60)
"""


def leader_with_child(child_code: str, stop_child: bool = False) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", LEADER, f"import signal, sys, time\n{child_code}",
                             "stop" if stop_child else "run"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, int(proc.stdout.readline())


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie has ended; its adopter reaps it, not we)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("child_code, stop_child, grace", [
    ("", False, 30.0),  # honours SIGTERM: ends at once, long before the grace period is over
    ("signal.signal(signal.SIGTERM, signal.SIG_IGN)", False, 0.5),  # ignores it: SIGKILL after the grace period
    ("", True, 30.0),  # stopped: the SIGCONT sent with SIGTERM lets it act on it
])
def test_what_a_group_leader_leaves_behind_is_ended_with_it(child_code, stop_child, grace):
    proc, child = leader_with_child(child_code, stop_child)
    try:
        started = time.monotonic()
        stop_process_group(proc, signal.SIGINT, timeout=10, kill_timeout=5, grace=grace)
        assert proc.returncode == 0  # the leader itself stopped gracefully
        assert not running(child)
        assert time.monotonic() - started < 20  # with grace 30: SIGTERM ended it, no SIGKILL needed
        assert not group_is_alive(proc.pid)
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_a_group_whose_leader_exited_already_is_still_cleared():
    proc, child = leader_with_child("")
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0 and running(child)  # the server is gone, its child is not
        stop_process_group(proc, signal.SIGINT, timeout=10, kill_timeout=5, grace=5)
        assert not running(child)
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)
