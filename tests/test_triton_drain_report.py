"""drain_report: the launcher ends tritonserver only once EVERY Python backend stub it runs has
reported its drain complete, and never while one has not (a stub of another model writes no
report). Real processes stand in: a parent for tritonserver, children running a copy of `sleep`
named like the stub (what /proc/<pid>/exe shows for a real one), and one child that is
no stub. tests/test_triton_shutdown.py covers the whole path on a real tritonserver."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pagedserve.adapters.triton_server.drain_report import (STUB_EXECUTABLE, drained_since, marker_path,
                                                            report_drained, stub_pids)

SERVER = textwrap.dedent("""
    import subprocess, sys
    stub = sys.argv[1]
    children = [subprocess.Popen([stub, "60"]) for _ in range(2)]  # what tritonserver starts per instance
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(" ".join(str(c.pid) for c in (*children, other)), flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def server(tmp_path):
    stub = tmp_path / STUB_EXECUTABLE
    shutil.copy(shutil.which("sleep"), stub)  # /proc/<pid>/exe names the file run, not a link to it
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(stub)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    yield proc, pids, tmp_path / "shutting-down"
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()


def test_the_drain_counts_only_once_every_stub_has_reported(server):
    proc, (stub_a, stub_b, other), notice = server
    assert stub_pids(proc.pid) == {stub_a, stub_b}  # the non-stub child is not waited for
    assert drained_since(notice, proc.pid) is None
    marker_path(notice, stub_b).write_text("200.0\n")  # as report_drained writes it, for that stub
    assert drained_since(notice, proc.pid) is None  # one stub still drains
    marker_path(notice, other).write_text("300.0\n")  # not a stub: neither needed nor counted
    assert drained_since(notice, proc.pid) is None
    marker_path(notice, stub_a).write_text("100.0\n")
    assert drained_since(notice, proc.pid) == 200.0  # the later of the stubs' last responses


def test_no_stub_means_no_report(tmp_path):
    """A server whose stubs are gone (or not started) is never taken for drained: the launcher then
    waits for tritonserver itself."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stub_pids(os.getpid()) == set()
        assert drained_since(tmp_path / "shutting-down", os.getpid()) is None
    finally:
        child.kill()
        child.wait()


def test_a_report_is_written_whole(tmp_path):
    notice = tmp_path / "shutting-down"
    path = report_drained(notice, 12.5)
    assert path == marker_path(notice, os.getpid()) and float(path.read_text()) == 12.5
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
