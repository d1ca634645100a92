"""`pagedserve triton`: run the real tritonserver from the nvidia-pytriton wheel on our repository.

    pagedserve triton [--model-repository DIR] [--model PATH|default] [--host 127.0.0.1]
                      [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
                      [--timeout 600] [--enable-lora --lora-modules NAME=PATH ... [--max-loras N]
                      [--max-lora-rank R] [--max-cpu-loras M]] [-- extra tritonserver flags]
    pagedserve triton --write-repository DIR    (a copy of the shipped repository to edit, then exit)

The wheel carries a complete Triton 2.51 server with the Python backend and its stubs; no GPU or
CUDA driver is needed. What it takes (docs/contracts.md, Triton):

* a backend directory `<dir>/python/` of SYMLINKS to the wheel's libtriton_python.so,
  triton_python_backend_utils.py and the stub for this Python (a copied stub hangs the load);
* this virtualenv's `bin` first on PATH (the stub runs `python3` from there, which imports
  pagedserve) and the base interpreter's LIBDIR on LD_LIBRARY_PATH (the stub links libpython);
* a per-run shared-memory prefix, so a crashed stub's /dev/shm regions are found and removed.

The LoRA flags are `pagedserve kserve`'s; they are written into the repository served, as Triton's
vllm_backend reads them (lora_repository.py): the settings into engine.json, the adapters into
multi_lora.json. The shipped repository is served from a temporary copy then.

Tests and the benchmark start servers through `start_server()`, the same code as this command.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.adapters.child_process import stop_process_group
from pagedserve.adapters.triton_server.drain_report import FLUSH_GRACE_S, drained_since
from pagedserve.adapters.triton_server.engine_config import MODEL_OVERRIDE_ENV, SHUTDOWN_NOTICE_ENV
from pagedserve.adapters.triton_server.lora_repository import (add_lora_args, lora_settings_from_args,
                                                               write_lora_settings)

DEFAULT_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
"""The shipped repository (one model, pagedserve): src/pagedserve/model_repository/ of a checkout, or the
same folder installed as package data (site-packages/pagedserve/model_repository) from a wheel."""
EXIT_TIMEOUT_S = 30
"""tritonserver's --exit-timeout-secs: one budget for a stopping server to wait for its open HTTP
connections and then for its models to unload. It must exceed the models' drain_timeout
(engine.json, default 20 s), which the model spends letting requests in flight finish."""
DEFAULT_DRAIN_TIMEOUT_S = 20.0
"""LimitsConfig.drain_timeout's default (core/config.py; tests/test_triton_shutdown.py checks they
agree), for an engine.json that sets none: read here without importing the engine."""
STOP_GRACE_S = 1.5
"""How long `pagedserve triton` lets tritonserver run past the longest drain_timeout of its models
after passing on a stop signal, before it ends it (see _wait_for_exit). Models that report their
drain (drain_report.py) end it sooner; this bounds the rest. The models' drain period starts when
they see the notice (up to 0.1 s after the signal), the responses that end it go out after it,
and the report adds FLUSH_GRACE_S and two looks of 0.1 s: 0.5 s here cut a stream's final error
on a loaded machine; 1.5 s keeps every stop within drain_timeout + 2 s."""


def wheel_dir() -> Path:
    """The tritonserver inside the nvidia-pytriton wheel, found without importing pytriton (which
    imports numpy and more: about 50 MB this process would then hold while the server runs)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pagedserve triton needs the wheel nvidia-pytriton: pip install 'pagedserve[triton]' "
                         "(in a source checkout: pip install -e '.[triton]')")
    return Path(list(spec.submodule_search_locations)[0]).resolve() / "tritonserver"


def write_repository(target: str | Path) -> Path:
    """Copy the shipped model repository to `target` (new or empty) for editing; returns it."""
    target = Path(target)
    if not (DEFAULT_REPOSITORY / "pagedserve" / "config.pbtxt").is_file():
        raise SystemExit(f"the shipped model repository is missing at {DEFAULT_REPOSITORY}; reinstall pagedserve")
    if target.exists() and any(target.iterdir()):
        raise SystemExit(f"{target} is not empty; name a new or empty directory for --write-repository")
    shutil.copytree(DEFAULT_REPOSITORY, target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def make_backend_dir(root: Path) -> Path:
    """`root/python/` holding symlinks to the wheel's Python backend; returns root."""
    tritonserver = wheel_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = tritonserver / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    python = root / "python"
    python.mkdir(parents=True, exist_ok=True)
    for target in (tritonserver / "backends/python/libtriton_python.so",
                   tritonserver / "backends/python/triton_python_backend_utils.py", stub):
        link = python / target.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return root


def server_env(base: dict[str, str] | None = None, model_override: str | None = None,
               shutdown_notice: Path | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    if model_override:
        env[MODEL_OVERRIDE_ENV] = model_override
    if shutdown_notice is not None:
        env[SHUTDOWN_NOTICE_ENV] = str(shutdown_notice)
    return env


@dataclass
class TritonServer:
    """A running tritonserver, in a session of its own; `stop()` ends it and every process it started
    (its Python backend stubs) and removes its /dev/shm regions.

    Stop it through `send_stop_signal()` (or `stop()`), not by signalling the process alone: that
    first creates the shutdown notice its models watch, so that they start draining at once.
    tritonserver tells its models of a shutdown only once every HTTP connection has closed (an open
    SSE stream holds it up to the exit timeout) and every stream has ended (server_watch.py)."""

    process: subprocess.Popen
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    shm_prefix: str
    backend_dir: tempfile.TemporaryDirectory
    log_path: Path | None = None
    models: list[str] = field(default_factory=list)
    shutdown_notice: Path | None = None
    """The file whose existence tells the models that the server is stopping (SHUTDOWN_NOTICE_ENV)."""

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def wait_ready(self, timeout: float) -> None:
        """Until every model in self.models is ready; raises if the server exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} during startup"
                                   + self._log_hint())
            paths = [f"/v2/models/{m}/ready" for m in self.models] or ["/v2/health/ready"]
            if all(self._get(p) == 200 for p in paths):
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s" + self._log_hint())

    def _log_hint(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
        return f"; last log lines ({self.log_path}):\n" + "\n".join(tail)

    def send_stop_signal(self, sig: int = signal.SIGTERM) -> None:
        """Begin a graceful stop: the models' notice first (they refuse new requests and give those
        in flight drain_timeout), then `sig` (SIGTERM or SIGINT) to tritonserver."""
        if self.shutdown_notice is not None and self.process.poll() is None:
            self.shutdown_notice.touch()
        self.process.send_signal(sig)

    def kill(self) -> None:
        """End tritonserver and its stubs at once (SIGKILL to its session: the stubs ignore SIGTERM)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = EXIT_TIMEOUT_S + 10) -> None:
        # SIGINT to tritonserver alone: it unloads the models, whose stubs then exit. The rest of its
        # group is only what it could not end (it crashed or was killed): see stop_process_group.
        # Those stubs get SIGKILL at once (grace 0): they ignore SIGTERM, so a grace only waited
        # 5 s for nothing, and with tritonserver gone no response of theirs can reach a client.
        if self.shutdown_notice is not None and self.process.poll() is None:
            self.shutdown_notice.touch()
        stop_process_group(self.process, signal.SIGINT, timeout, kill_timeout=5, grace=0.0)
        self.cleanup()

    def cleanup(self) -> None:
        """Remove the server's /dev/shm regions and its backend directory (its processes are ended
        or SIGKILLed: a region still mapped by a dying stub goes once the stub is gone)."""
        for region in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            try:
                os.unlink(region)
            except OSError:
                pass
        self.backend_dir.cleanup()


def start_server(model_repository: str | Path = DEFAULT_REPOSITORY, *, host: str = "127.0.0.1",
                 http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 models: list[str] | None = None, model_override: str | None = None,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, wait: bool = True, timeout: float = 600.0) -> TritonServer:
    """Start tritonserver on `model_repository`; with `models`, load only those (explicit mode)."""
    repository = Path(model_repository).resolve()
    if not repository.is_dir():
        raise SystemExit(f"model repository {repository} does not exist; pass --model-repository")
    backend_dir = tempfile.TemporaryDirectory(prefix="pagedserve-triton-backends-")
    make_backend_dir(Path(backend_dir.name))
    shm_prefix = f"pagedserve_{uuid.uuid4().hex[:8]}_"
    shutdown_notice = Path(backend_dir.name) / "shutting-down"
    cmd = [str(wheel_dir() / "bin" / "tritonserver"), f"--model-repository={repository}",
           f"--backend-directory={backend_dir.name}",
           f"--http-address={host}", f"--grpc-address={host}", f"--metrics-address={host}",
           f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
           "--disable-auto-complete-config", "--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false",
           f"--exit-timeout-secs={EXIT_TIMEOUT_S}", "--backend-config=python,shm-default-byte-size=4194304",
           f"--backend-config=python,shm-region-prefix-name={shm_prefix}"]
    if models:
        cmd += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]
    cmd += list(extra_args or [])
    out = open(log_path, "wb") if log_path else None  # noqa: SIM115 - owned by the child from here on
    # A session of its own: its stubs share its process group, so stop() can end what it leaves
    # behind, and a terminal's Ctrl-C reaches only the launcher, which passes it on once.
    process = subprocess.Popen(cmd, env=server_env(env, model_override, shutdown_notice), stdout=out,
                               stderr=subprocess.STDOUT if out else None, start_new_session=True)
    if out:
        out.close()
    server = TritonServer(process, host, http_port, grpc_port, metrics_port, shm_prefix, backend_dir,
                          Path(log_path) if log_path else None, list(models or []), shutdown_notice)
    if wait:
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
    return server


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve triton", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY),
                   help="default: the shipped repository (one model, `pagedserve`, both contracts)")
    p.add_argument("--write-repository", metavar="DIR", default=None,
                   help="copy the shipped repository to DIR (to edit engine.json, add models) and exit; "
                        "then serve it with --model-repository DIR")
    p.add_argument("--model", default=None, help='override "model" in every engine.json (local HF directory '
                                                 'or "default", the embedded SmolLM2-135M-Instruct)')
    p.add_argument("--host", default="127.0.0.1", help="address for HTTP, gRPC and metrics (0.0.0.0 for all)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--load-model", action="append", default=None,
                   help="load only this model (repeatable); default: every model in the repository")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the models to be ready")
    add_lora_args(p)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags passed to tritonserver as-is")
    return p


class SignalForwarder:
    """Passes the signals that stop `pagedserve triton` on to tritonserver (with the models' shutdown
    notice first: TritonServer.send_stop_signal). Installed before the
    server starts, so no signal finds the launcher without its handler (it would die and leave the
    server running); one that comes before the server exists is sent as soon as it does. A hangup
    (the terminal closed) becomes SIGTERM: tritonserver handles INT and TERM only. Under nohup,
    SIGHUP stays ignored; SIGINT and SIGTERM are handled even when inherited as ignored (a shell
    starts background jobs with SIGINT ignored, and an explicit SIGINT must still stop the server)."""

    SENT_AS = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}

    def __init__(self) -> None:
        self.received: list[int] = []
        self.first_at: float | None = None
        """time.monotonic() of the first signal."""
        self._pending: list[int] = []
        self._server: TritonServer | None = None
        self._previous = {sig: signal.getsignal(sig) for sig in self.SENT_AS}
        for sig in self.SENT_AS:
            if sig != signal.SIGHUP or self._previous[sig] is not signal.SIG_IGN:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        if not self.received:
            self.first_at = time.monotonic()
        self.received.append(signum)
        if self._server is None:
            self._pending.append(signum)
        else:
            self._server.send_stop_signal(self.SENT_AS[signum])

    def attach(self, server: TritonServer) -> None:
        """From now on signals go to `server`; those that came before go now. Handlers run on this
        thread between bytecodes, so each signal is sent exactly once: by the handler once
        `_server` is set, or from `_pending` here."""
        self._server = server
        while self._pending:
            server.send_stop_signal(self.SENT_AS[self._pending.pop(0)])

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.write_repository:
        target = write_repository(args.write_repository)
        print(f"wrote the pagedserve model repository to {target}; edit {target}/pagedserve/1/engine.json, then:\n"
              f"  pagedserve triton --model-repository {target}")
        return 0
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    copy = _write_lora_flags(args)
    # SIGINT/SIGTERM go to tritonserver, which unloads the models (each finishes its requests).
    forwarder = SignalForwarder()
    try:
        server = start_server(args.model_repository, host=args.host, http_port=args.http_port,
                              grpc_port=args.grpc_port, metrics_port=args.metrics_port, models=args.load_model,
                              model_override=args.model, extra_args=extra, wait=False)
        forwarder.attach(server)
        return _serve(server, args, forwarder)
    finally:
        forwarder.restore()
        if copy is not None:
            copy.cleanup()


def _write_lora_flags(args: argparse.Namespace) -> tempfile.TemporaryDirectory | None:
    """Write the LoRA flags into the repository to serve (a temporary copy of the shipped one, which
    is then returned for removal at exit, and args.model_repository points at it)."""
    lora = lora_settings_from_args(args)
    if lora is None:
        return None
    copy = None
    if Path(args.model_repository).resolve() == DEFAULT_REPOSITORY.resolve():
        copy = tempfile.TemporaryDirectory(prefix="pagedserve-triton-repository-")
        args.model_repository = str(write_repository(copy.name))
    for path in write_lora_settings(Path(args.model_repository), *lora, args.load_model):
        print(f"pagedserve triton: wrote the LoRA settings to {path}", flush=True)
    return copy


def _serve(server: TritonServer, args: argparse.Namespace, forwarder: SignalForwarder) -> int:
    try:
        server.wait_ready(args.timeout)
        host = args.host if args.host != "0.0.0.0" else "127.0.0.1"
        print(f"""
pagedserve is serving on tritonserver (Ctrl-C stops it):
  HTTP {args.host}:{args.http_port}   gRPC {args.host}:{args.grpc_port}   metrics http://{host}:{args.metrics_port}/metrics

  curl -s http://{host}:{args.http_port}/v2/models/pagedserve/generate \\
       -d '{{"text_input": "What is a paged KV cache?", "parameters": {{"max_tokens": 64, "temperature": 0}}}}'
  curl -sN http://{host}:{args.http_port}/v2/models/pagedserve/generate_stream \\
       -d '{{"text_input": "What is a paged KV cache?", "stream": true, "parameters": {{"max_tokens": 64, "temperature": 0}}}}'
  gRPC streaming with tritonclient.grpc: see docs/triton.md
""", flush=True)
    except (RuntimeError, TimeoutError) as exc:
        if not forwarder.received:
            print(f"pagedserve triton: {exc}", file=sys.stderr)
        server.stop()
        return 1
    drain_timeout = longest_drain_timeout(Path(args.model_repository), args.load_model)
    code, ended_here = _wait_for_exit(server, forwarder, drain_timeout)
    if ended_here:  # its whole session got SIGKILL: nothing to wait for (a loaded host takes seconds to reap it)
        server.cleanup()
    else:
        server.stop()
    if not forwarder.received:
        return code  # it exited unasked: its own status
    if ended_here or code == 0:
        return 0
    # Stopped, but tritonserver did not exit cleanly by itself: a fault inside Triton on its way out
    # (2.51 was seen to take a SIGSEGV as it began unloading a model after a client abandoned a stream).
    how = f"signal {-code}" if code < 0 else f"status {code}"
    print(f"pagedserve triton: tritonserver ended with {how} while stopping (see its log above); its Python "
          "backend stubs were ended", file=sys.stderr, flush=True)
    return 1


def longest_drain_timeout(repository: Path, models: list[str] | None) -> float:
    """The longest drain_timeout of the models served from `repository` (every engine.json of
    theirs; DEFAULT_DRAIN_TIMEOUT_S where one sets none or cannot be read: the model itself then
    fails its load and drains nothing)."""
    longest = 0.0
    for engine_json in repository.glob("*/*/engine.json"):
        if models and engine_json.parent.parent.name not in models:
            continue
        try:
            value = json.loads(engine_json.read_text()).get("drain_timeout", DEFAULT_DRAIN_TIMEOUT_S)
            longest = max(longest, float(value))
        except (OSError, ValueError, TypeError, AttributeError):
            longest = max(longest, DEFAULT_DRAIN_TIMEOUT_S)
    return longest or DEFAULT_DRAIN_TIMEOUT_S


def _wait_for_exit(server: TritonServer, forwarder: SignalForwarder, drain_timeout: float) -> tuple[int, bool]:
    """tritonserver's exit status, and whether the launcher ended it. Once a stop signal has been passed on, the models end every
    request still open by drain_timeout (the notice reaches them at once); what tritonserver waits
    for after that holds nothing a client still needs, and takes long:

    * every model reports its drain complete (drain_report.py): the launcher ends the server's
      session FLUSH_GRACE_S after the last response, instead of waiting 2-3 s for Triton's own
      shutdown steps (an idle server exits in well under a second);
    * where one does not (a model of another kind, a stub that cannot write the file), an open gRPC
      stream, even one idle since its last request ended, keeps the model loaded (the stream keeps
      its last request, which refers to the model) until its client closes it, past the exit timeout
      too (Triton 2.51's gRPC Server::Stop waits for every open call with no deadline). So
      STOP_GRACE_S past the longest drain_timeout the launcher ends the server's session itself."""
    while True:
        deadline = None if forwarder.first_at is None else forwarder.first_at + drain_timeout + STOP_GRACE_S
        try:  # in steps: a signal's handler runs between them (a blocking wait would not see its time)
            step = 0.1 if deadline is None else min(max(deadline - time.monotonic(), 0.0), 0.1)
            return server.process.wait(timeout=step), False
        except subprocess.TimeoutExpired:
            if deadline is not None and server.shutdown_notice is not None:
                last_response = drained_since(server.shutdown_notice, server.process.pid)
                if last_response is not None and time.monotonic() >= last_response + FLUSH_GRACE_S:
                    server.kill()  # nothing left in it: every model drained and its engine is shut down
                    return server.process.wait(), True
            if deadline is not None and time.monotonic() >= deadline:
                print(f"pagedserve triton: tritonserver still runs {drain_timeout + STOP_GRACE_S:g} s after the "
                      f"stop signal, though its models' drain period ({drain_timeout:g} s) is over: it waits for "
                      "clients to close idle streams or connections; ending it", file=sys.stderr, flush=True)
                server.kill()
                return server.process.wait(), True


if __name__ == "__main__":
    sys.exit(main())
