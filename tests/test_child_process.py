"""stop_process: the graceful signal first, SIGKILL only for a child that ignores it."""

from __future__ import annotations

import signal
import subprocess
import sys

from pagedserve.adapters.child_process import stop_process


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
