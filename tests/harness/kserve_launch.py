"""Run `pagedserve kserve` in a child process and wait until the model is ready (tests and
benchmarks). Imports no kserve: the server has its own interpreter, so the caller may use
tritonclient.grpc (which cannot share a process with kserve)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.adapters.child_process import stop_process

from .local_ports import free_ports
from .readiness import wait_until_ready


@dataclass
class KServeProcess:
    proc: subprocess.Popen
    model_name: str
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def openai_url(self) -> str:
        return f"{self.url}/openai/v1"

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (kserve drains and stops), SIGKILL if it does not exit in time."""
        stop_process(self.proc, signal.SIGTERM, timeout, kill_timeout=10)


def start_kserve(model: str | Path, log_path: Path, model_name: str = "pagedserve",
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 timeout: float = 300.0) -> KServeProcess:
    """Start the server on loopback free ports; return once /v2/models/<name>/ready answers 200
    (the engine has loaded and warmed up). Raises with the log's tail if it exits or times out."""
    http_port, grpc_port = free_ports(2)
    cmd = [sys.executable, "-m", "pagedserve.tools.cli", "kserve", "--model", str(model), "--model-name", model_name,
           "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = KServeProcess(proc, model_name, http_port, grpc_port, Path(log_path))
    try:
        wait_until_ready(proc, f"{server.url}/v2/models/{model_name}/ready", "the kserve server", server.log_tail,
                         timeout)
        return server
    except BaseException:
        server.stop()
        raise
