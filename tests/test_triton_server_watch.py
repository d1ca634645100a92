"""server_watch: the TCP ports a process listens on, read from /proc, checked against what the
process itself says of its sockets (their fds and inodes, from os.fstat); the watch the Triton
model polls, which reports a shutdown once a port seen open is gone, and never before; and the
model-control mode read from a process's command line; the launcher's shutdown notice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.adapters.triton_server.server_watch import (ServerShutdownWatch, explicit_model_control,
                                                            listening_ports)

SERVER = r"""
import json, os, socket, sys
sockets = {}
def listen(name, family=socket.AF_INET, host="127.0.0.1"):
    s = socket.socket(family)
    s.bind((host, 0))
    s.listen()
    sockets[name] = s
listen("http")
listen("grpc", socket.AF_INET6, "::1")
connected = socket.create_connection(sockets["http"].getsockname())  # a TCP socket, not listening
pair = socket.socketpair()  # not TCP
def report():
    ports = {name: [s.fileno(), os.fstat(s.fileno()).st_ino] for name, s in sockets.items()}
    print(json.dumps({"ports": ports, "other": [os.fstat(s.fileno()).st_ino for s in (connected, *pair)]}), flush=True)
report()
for line in sys.stdin:
    command, name = line.split()
    if command == "listen":
        listen(name)
    elif command == "close":
        sockets.pop(name).close()
    elif command == "reuse":  # close it, and let a file take its fd number
        fd = sockets.pop(name).detach()
        os.close(fd)
        assert os.open(os.devnull, os.O_RDONLY) == fd
    report()
"""


class Server:
    """A child process standing in for tritonserver: it listens, and closes ports when told."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.state = json.loads(self.process.stdout.readline())

    def tell(self, command: str, name: str) -> None:
        self.process.stdin.write(f"{command} {name}\n")
        self.process.stdin.flush()
        self.state = json.loads(self.process.stdout.readline())

    def ports(self) -> dict[str, int]:
        """fd -> inode of its listening sockets, as the process itself sees them."""
        return {str(fd): inode for fd, inode in self.state["ports"].values()}


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.process.kill()
    srv.process.wait()


def test_listening_ports_are_the_tcp_sockets_a_process_listens_on(server):
    found = listening_ports(server.process.pid)
    assert found == server.ports() and len(found) == 2  # IPv4 and IPv6
    assert not set(found.values()) & set(server.state["other"])  # not the connected or unix sockets
    server.tell("close", "http")
    assert listening_ports(server.process.pid) == server.ports() and len(server.ports()) == 1


def test_a_process_that_is_gone_cannot_be_read():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert listening_ports(proc.pid) is None
    assert ServerShutdownWatch(proc.pid).shutting_down() is None


def test_the_watch_reports_a_port_closed_after_the_ports_settled(server):
    watch = ServerShutdownWatch(server.process.pid)
    assert watch.shutting_down() is False and watch.shutting_down() is False  # two looks alike
    assert watch.shutting_down() is False
    server.tell("close", "http")
    assert watch.shutting_down() is True
    assert watch.shutting_down() is True  # and stays so


def test_the_watch_reports_a_port_closed_before_the_ports_settled(server):
    watch = ServerShutdownWatch(server.process.pid)
    assert watch.shutting_down() is False
    server.tell("close", "grpc")
    assert watch.shutting_down() is True
    assert watch.shutting_down() is True


def test_a_port_opened_after_the_first_look_is_watched_too(server):
    watch = ServerShutdownWatch(server.process.pid)
    assert watch.shutting_down() is False
    server.tell("listen", "metrics")  # ports open one after another while the server starts
    assert watch.shutting_down() is False and watch.shutting_down() is False
    server.tell("close", "metrics")
    assert watch.shutting_down() is True


def test_a_port_whose_fd_now_holds_something_else_is_closed(server):
    watch = ServerShutdownWatch(server.process.pid)
    assert watch.shutting_down() is False and watch.shutting_down() is False
    server.tell("reuse", "grpc")
    assert watch.shutting_down() is True


def test_a_server_without_open_ports_is_not_shutting_down(server):
    """A starting server has no ports open yet: that is no shutdown, however often the watch looks."""
    server.tell("close", "http")
    server.tell("close", "grpc")
    watch = ServerShutdownWatch(server.process.pid)
    assert [watch.shutting_down() for _ in range(3)] == [False, False, False]
    server.tell("listen", "http")
    assert watch.shutting_down() is False and watch.shutting_down() is False
    server.tell("close", "http")
    assert watch.shutting_down() is True


def test_the_launchers_notice_is_seen_while_every_port_is_still_open(server, tmp_path):
    """`pagedserve triton` announces a stop by creating the notice file before it signals
    tritonserver, whose HTTP port may stay open for its whole exit timeout (an SSE stream open)."""
    notice = tmp_path / "shutting-down"
    watch = ServerShutdownWatch(server.process.pid, str(notice))
    assert not watch.noticed() and watch.shutting_down() is False
    notice.touch()
    assert watch.noticed()
    assert watch.shutting_down() is False  # the ports say nothing yet
    assert not ServerShutdownWatch(server.process.pid).noticed()  # no notice named: none seen


@pytest.mark.parametrize("args,explicit", [
    (["--model-control-mode=explicit", "--load-model=pagedserve"], True),
    (["--model-control-mode", "explicit"], True),
    (["--model-control-mode=poll"], False),
    ([], False),  # Triton's default: none
    (["--model-control-mode=explicit", "--model-control-mode=none"], False),  # the last one counts
    (["--model-repository=/models/--model-control-mode=explicit"], False),  # only the option itself
])
def test_explicit_model_control_is_read_from_the_command_line(args, explicit):
    """A child whose argv carries the options as tritonserver's would (python ignores what follows -c).
    It says when it runs: until its exec is through, /proc shows an empty command line."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()", *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert explicit_model_control(child.pid) is explicit
    finally:
        child.communicate(timeout=10)


def test_explicit_model_control_of_a_process_gone_is_unknown():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    assert explicit_model_control(child.pid) is None
