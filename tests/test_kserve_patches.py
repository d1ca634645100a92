"""adapters/kserve/server.py patches kserve internals (the HTTP and gRPC bind address, the drain
on SIGTERM). These tests fail when the installed kserve is not the one pyproject.toml pins, or when
the internals the patch relies on have changed, so a kserve upgrade is a deliberate step.

kserve runs in a child interpreter: it cannot share a process with tritonclient.grpc, which other
tests import (docs/kserve.md)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def kserve_requirement() -> Requirement:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [Requirement(r) for r in extras["kserve"] if Requirement(r).name == "kserve"]
    return spec


def test_installed_kserve_is_the_pinned_release():
    spec = kserve_requirement()
    assert spec.specifier, "pin kserve to the release adapters/kserve/server.py is written for"
    try:
        installed = importlib.metadata.version("kserve")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kserve is not installed (pip install -e '.[kserve]')")
    assert spec.specifier.contains(installed), (
        f"kserve {installed} is installed but pyproject.toml pins {spec}: check the patched internals "
        "(this file) against the new release before moving the pin")


CHECK = r'''
import inspect, signal, sys

import grpc.aio
import uvicorn
from fastapi import FastAPI
from kserve import model_server
from kserve.protocol.grpc import server as grpc_server
from kserve.protocol.rest import server as rest_server

from pagedserve.adapters.kserve.server import _patch_rest_server

# What the patch relies on, as kserve has it before the patch.
start = inspect.getsource(model_server.ModelServer.start)
assert "RESTServer(" in start and model_server.RESTServer is rest_server.RESTServer, (
    "ModelServer.start no longer builds its server from model_server.RESTServer")
init = inspect.getsource(rest_server.RESTServer.__init__)
assert "self.config = uvicorn.Config(" in init and 'host="0.0.0.0"' in init and "self._server = " in init, (
    "RESTServer no longer keeps a uvicorn.Config bound to 0.0.0.0 in .config and its server in ._server")
assert issubclass(type(rest_server.RESTServer("app", None, None, 0)._server), uvicorn.Server)
assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == ["self", "sig", "frame"]
grpc_start = inspect.getsource(grpc_server.GRPCServer.start)
assert grpc_server.aio is grpc.aio and "aio.server(" in grpc_start, "GRPCServer no longer calls grpc.aio.server"
assert 'f"[::]:{self._port}"' in grpc_start and "add_insecure_port(listen_addr)" in grpc_start, (
    "GRPCServer no longer binds [::]:port through add_insecure_port")
assert isinstance(model_server.app, FastAPI), "model_server.app is no longer the FastAPI app the routes go on"
params = inspect.signature(model_server.ModelServer.__init__).parameters
missing = {"http_port", "grpc_port", "enable_grpc", "workers", "grace_period"} - set(params)
assert not missing, f"ModelServer() no longer takes {missing}"

# The patch applied: the REST server binds the host and starts the drain on SIGTERM, the gRPC
# server binds the host instead of [::].
drained = []
_patch_rest_server("127.0.0.1", lambda: drained.append(1))
rest = model_server.RESTServer("app", None, None, 0)
assert rest.config.host == "127.0.0.1"
rest._server.handle_exit(signal.SIGTERM, None)
assert drained == [1] and rest._server.should_exit
bound = []


class FakeGrpcServer:
    def add_insecure_port(self, address):
        bound.append(address)
        return 1


grpc.aio.server = lambda *args, **kwargs: FakeGrpcServer()  # what kserve's grpc_server.aio.server calls
grpc_server.aio.server().add_insecure_port("[::]:8081")
assert bound == ["127.0.0.1:8081"], bound
print("ok")
'''


def test_the_patched_kserve_internals_are_as_expected():
    if importlib.util.find_spec("kserve") is None:
        pytest.skip("kserve is not installed (pip install -e '.[kserve]')")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
