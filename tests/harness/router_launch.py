"""Run vllm-router (PyPI's `vllm-router`, a Rust binary behind a Python launcher) in front of
`pagedserve kserve` replicas on loopback, and wait until it answers (tests/test_router_replicas.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.adapters.child_process import stop_process

from .local_ports import free_ports
from .readiness import wait_until_ready

ROUTER_ARGS = ("--policy", "cache_aware",
               # Notice a dead replica within about a second (the defaults poll every 60 s) ...
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               # ... and retry for longer than that (backoff 50 ms x 1.5 per try: 8 tries span ~2.4 s,
               # the default 5 only ~0.7 s), so that a request the router sent to the dead replica
               # before it noticed is retried on the other one instead of failing.
               "--retry-max-retries", "8",
               "--worker-startup-check-interval", "1")
"""The router's flags here and in deploy/router/ (test_router_manifests.py checks they agree)."""


@dataclass
class RouterProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, timeout=10, kill_timeout=10)


def start_router(worker_urls: Sequence[str], log_path: Path, args: Sequence[str] = ROUTER_ARGS,
                 timeout: float = 120.0) -> RouterProcess:
    """The router on a free loopback port (its Prometheus port too: the default, 29000, would clash
    between runs); returns once its /health answers 200, which it does after every worker's
    /health has."""
    port, metrics_port = free_ports(2)
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--worker-urls", *worker_urls, *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    router = RouterProcess(proc, port, Path(log_path))
    try:
        wait_until_ready(proc, f"{router.url}/health", "vllm-router", router.log_tail, timeout)
        return router
    except BaseException:
        router.stop()
        raise
