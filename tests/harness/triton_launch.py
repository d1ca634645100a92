"""Run a real tritonserver on a copy of the shipped model repository with the given engine.json
(tests): the steps every Triton server test repeats, in one place."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pagedserve.adapters.triton_server.launcher import DEFAULT_REPOSITORY, TritonServer, start_server

from . import ONE_THREAD
from .local_ports import free_ports



def start_triton_on(workdir: Path, engine_settings: dict, *, env: dict[str, str] | None = None,
                    timeout: float = 300) -> TritonServer:
    """tritonserver serving the one-model shipped repository, copied under `workdir` with
    `engine_settings` as its engine.json, on free loopback ports, one compute thread; `env` adds to
    the environment (e.g. PAGEDSERVE_CACHE_DIR)."""
    repo = workdir / "model_repository"
    shutil.copytree(DEFAULT_REPOSITORY, repo)
    (repo / "pagedserve" / "1" / "engine.json").write_text(json.dumps(engine_settings))
    http, grpc, metrics = free_ports(3)
    return start_server(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, models=["pagedserve"],
                        env={**os.environ, **ONE_THREAD, **(env or {})}, log_path=workdir / "tritonserver.log",
                        timeout=timeout)
