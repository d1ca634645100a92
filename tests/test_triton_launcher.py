"""`pagedserve triton`'s signal handling (launcher.main): a signal that stops the launcher always
reaches tritonserver, even one that comes while the server is being started, and a hangup reaches
it as SIGTERM (tritonserver handles INT and TERM only).

tritonserver is replaced by a stand-in child that records the signal it gets, and start_server by
a stub that starts it the way start_server does (a session of its own) and then signals the
launcher before returning: the moment between starting the server and any later handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

LAUNCHER = """
import os, signal, subprocess, sys, tempfile
from pagedserve.adapters.triton_server import launcher

SERVER = '''
import signal, sys, time
def record(signum, _frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(0)
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, record)
print("up", flush=True)
time.sleep(60)
'''

def start_server(*_args, **_kwargs):
    process = subprocess.Popen([sys.executable, "-c", SERVER, sys.argv[1]], stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    assert process.stdout.readline().strip() == "up"
    print(process.pid, flush=True)
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))  # the launcher is told to stop before it returns
    return launcher.TritonServer(process, "127.0.0.1", 1, 1, 1, "pagedserve_test_", tempfile.TemporaryDirectory())

launcher.start_server = start_server
# As in a terminal session, whatever ran this suite: under nohup SIGHUP would stay ignored (by
# design, test_the_launcher_leaves_the_handlers_it_found), and SIGINT too in a background job.
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(launcher.main(["--timeout", "30"]))
"""


@pytest.mark.parametrize("sent, received", [("SIGINT", "SIGINT"), ("SIGTERM", "SIGTERM"), ("SIGHUP", "SIGTERM")])
def test_a_signal_while_the_server_starts_stops_the_server(tmp_path, sent, received):
    record = tmp_path / "signal"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(record), sent], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    server_pid = None
    try:
        server_pid = int(proc.stdout.readline())
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        if server_pid is not None and running(server_pid, wait=0):
            os.kill(server_pid, signal.SIGKILL)
    # The launcher handled the signal (a launcher it killed has returncode -signal and leaves the
    # server running): it passed it on, the server stopped, and startup ended quietly with 1.
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "pagedserve triton:" not in err
    assert record.read_text() == received
    assert not running(server_pid)


def test_the_launcher_leaves_the_handlers_it_found():
    from pagedserve.adapters.triton_server.launcher import SignalForwarder

    before = {sig: signal.getsignal(sig) for sig in SignalForwarder.SENT_AS}
    original_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    original_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a shell's background job
    try:
        forwarder = SignalForwarder()
        assert signal.getsignal(signal.SIGINT) == forwarder._handle  # an explicit SIGINT still stops it
        assert signal.getsignal(signal.SIGTERM) == forwarder._handle
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # nohup's choice stands
        forwarder.restore()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, original_hup)
        signal.signal(signal.SIGINT, original_int)
    assert {sig: signal.getsignal(sig) for sig in SignalForwarder.SENT_AS} == before


def running(pid: int, wait: float = 5.0) -> bool:
    """Whether `pid` still runs after waiting up to `wait` seconds for it to end (a zombie has ended)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
