"""Stopping `pagedserve triton` the way a user and Kubernetes do (SIGTERM, or Ctrl-C's SIGINT, to the
launcher), seen from its clients: a REAL tritonserver on a tiny random model, with the stock
clients (tritonclient.grpc, raw HTTP as curl -N).

* Four streams in flight, two over HTTP /generate_stream and two over gRPC, one short and one far
  longer than drain_timeout over each: the short ones finish in full, the long ones end with an
  error naming the drain period, every one within drain_timeout + 2 s of the signal, and the
  server exits by then too (issue 29, item 2: the long ones used to be cut off at Triton's 30 s exit
  timeout without a final response).
* An idle server exits within TRITON_IDLE_EXIT_S of SIGTERM and of SIGINT (the issue asks for 2 s;
  Triton's own fixed steps take 2 s before its teardown, see TRITON_IDLE_EXIT_S).
* A stream its client abandoned (`curl -sN ... | head -3`), then an immediate SIGINT: the server
  exits within drain_timeout + 2 s, every time (20 servers in a row; slow).

The repository loads tests/server_hooks (a fixed delay per step), so the streams' lengths do not
depend on machine speed.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pagedserve.adapters.triton_server.launcher import DEFAULT_REPOSITORY, STOP_GRACE_S

from tests.harness.local_ports import free_ports
from tests.reliability_helpers import install_triton_hooks
from tests.shutdown_helpers import (DRAIN_TIMEOUT, LONG_TOKENS, MARGIN, SHORT_TOKENS, STEP_DELAY,
                                    StreamEnd, consume_sse, kill_if_running, one_thread_env, read_sse_events,
                                    signal_and_time_exit, sse_post, start_thread, tail, wait_http_ready)
from tests.triton_helpers import GrpcStream, http_post, text_inputs

pytestmark = pytest.mark.timeout(600)

PROMPT = "The paged KV cache hands out blocks"
TRITON_IDLE_EXIT_S = 4.0
"""SIGTERM or SIGINT to exit of an idle `pagedserve triton`: 2.3-3 s measured here. Triton 2.51's
own steps take 2 s at the least (its Python backend sleeps 1 s, a stub health check, before the
model's finalize(); TRITONSERVER_ServerStop looks for the unloaded model once a second), then it
stops its endpoints and tears down (0.3-1 s). The model's part (finalize about 30 ms, the stub's
exit about 0.5 s) must land before Triton's second look; one that misses it costs a whole second."""
GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Launched:
    """`pagedserve triton` in a child process, as a user runs it."""

    def __init__(self, tmp, model_dir, delay: float) -> None:
        repo = tmp / "model_repository"
        if not repo.exists():
            shutil.copytree(DEFAULT_REPOSITORY, repo)
            (repo / "pagedserve" / "1" / "engine.json").write_text(json.dumps({
                "model": str(model_dir), "dtype": "float32", "max_model_len": LONG_TOKENS + 64, "max_num_seqs": 8,
                "num_kv_blocks": 1024, "drain_timeout": DRAIN_TIMEOUT}))
            install_triton_hooks(repo / "pagedserve", delay, None)
        self.http, self.grpc, metrics = free_ports(3)
        self.log_path = tmp / "pagedserve-triton.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.tools.cli", "triton", "--model-repository", str(repo),
                 "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(metrics)],
                stdout=log, stderr=subprocess.STDOUT, env=one_thread_env())
        try:
            wait_http_ready(f"{self.http_url}/v2/models/pagedserve/ready", self.proc, self.log_path)
            # and for the launcher to say so (it also waits for the metrics port): a signal before
            # that is a stop during start-up, which the launcher reports with exit status 1
            deadline = time.monotonic() + 60
            while "pagedserve is serving" not in self.log_path.read_text(errors="replace"):
                assert self.proc.poll() is None and time.monotonic() < deadline, tail(self.log_path)
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_if_running(self.proc)


@pytest.fixture
def launch(tmp_path, tiny_model_dir):
    servers = []

    def make(delay: float = STEP_DELAY) -> Launched:
        srv = Launched(tmp_path, tiny_model_dir("llama"), delay)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


def _sse_stream(srv: Launched, name: str, max_tokens: int) -> tuple[StreamEnd, object]:
    end = StreamEnd(name)
    sock = sse_post(f"{srv.http_url}/v2/models/pagedserve/generate_stream",
                    {"text_input": PROMPT, "stream": True, "parameters": {"max_tokens": max_tokens, **GREEDY}})
    first = next(read_sse_events(sock, stop_after=1))  # in flight before the signal
    assert "text_output" in json.loads(first), first
    end.deltas = 1
    return end, start_thread(consume_sse, end, sock, lambda e: "error" in e, lambda e: False)


def _grpc_stream(srv: Launched, name: str, max_tokens: int) -> tuple[StreamEnd, object, GrpcStream]:
    end = StreamEnd(name)
    stream = GrpcStream(f"127.0.0.1:{srv.grpc}")
    stream.send("pagedserve", text_inputs(PROMPT, True, {"max_tokens": max_tokens, **GREEDY}))
    head = stream.collect(stop_after=1)
    assert head.error is None and len(head.responses) == 1

    def consume() -> None:
        res = stream.collect(timeout=120)  # until the final response or an error
        end.deltas = 1 + len(res.responses)
        end.final = res.error is None and bool(res.finals) and res.finals[-1]
        end.error = None if res.error is None else res.error.message()
        end.ended_at = time.monotonic()

    return end, start_thread(consume), stream


def test_sigterm_drains_streams_over_both_protocols_and_ends_the_long_ones_with_an_error(launch):
    srv = launch()
    sse_short, t1 = _sse_stream(srv, "sse-short", SHORT_TOKENS)
    sse_long, t2 = _sse_stream(srv, "sse-long", LONG_TOKENS)
    grpc_short, t3, s3 = _grpc_stream(srv, "grpc-short", SHORT_TOKENS)
    grpc_long, t4, s4 = _grpc_stream(srv, "grpc-long", LONG_TOKENS)
    try:
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        for t in (t1, t2, t3, t4):
            t.join(timeout=DRAIN_TIMEOUT + 30)
        # The gRPC clients keep their streams open, idle, after the end (as a client that reuses its
        # stream does): that must not hold up the server's exit.
        code = srv.proc.wait(timeout=60)
        exited = time.monotonic() - signalled
    finally:
        s3.close()
        s4.close()
    ends = {e.name: e for e in (sse_short, sse_long, grpc_short, grpc_long)}
    log = tail(srv.log_path, 80)
    for name in ("sse-short", "grpc-short"):  # in flight at the signal: finished in full
        e = ends[name]
        assert e.error is None and e.deltas == SHORT_TOKENS, (name, e, log)
    assert ends["grpc-short"].final
    for name in ("sse-long", "grpc-long"):  # cut off when the drain period ended, with an error saying so
        e = ends[name]
        assert e.error is not None and "drain period" in e.error, (name, e, log)
        assert e.deltas < LONG_TOKENS
    for e in ends.values():
        assert e.ended_at is not None and e.ended_at - signalled < DRAIN_TIMEOUT + MARGIN, (e.name, e, log)
    assert code == 0, log
    assert exited < DRAIN_TIMEOUT + MARGIN, f"exited {exited:.1f} s after SIGTERM\n{log}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_idle_server_exits_within_tritons_own_steps(launch, sig):
    srv = launch(0.0)
    status, body = http_post(f"{srv.http_url}/v2/models/pagedserve/generate",
                             {"text_input": PROMPT, "parameters": {"max_tokens": 4}})
    assert status == 200, body
    code, took = signal_and_time_exit(srv.proc, sig)
    assert code == 0, tail(srv.log_path)
    assert took < TRITON_IDLE_EXIT_S, f"an idle server took {took:.1f} s to exit after {sig.name}\n{tail(srv.log_path)}"


ABANDONED_RUNS = 20


@pytest.mark.slow
def test_an_abandoned_stream_then_sigint_exits_within_the_drain_period_every_time(launch):
    """`curl .../generate`, then `curl -sN .../generate_stream | head -3` (the client goes away
    mid-stream), then Ctrl-C at once, 20 times: the server exits within drain_timeout + 2 s every
    time (it used to wait out Triton's 30 s exit timeout about 1 run in 3).

    Where tritonserver itself crashes while it unloads the model ("Signal (11) received" in its
    log, then it hangs; seen a few runs in 20 on a loaded 2-core machine, inside Triton), the
    launcher ends it STOP_GRACE_S past the drain period, and the kernel then takes up to ~2 s to
    reap the crashed process (its core dump): such a run must exit by drain_timeout + STOP_GRACE_S
    + 2 s, and the report names it."""
    took, crashed = [], []
    for _ in range(ABANDONED_RUNS):
        srv = launch()
        status, body = http_post(f"{srv.http_url}/v2/models/pagedserve/generate",
                                 {"text_input": PROMPT, "parameters": {"max_tokens": 4}})
        assert status == 200, body
        sock = sse_post(f"{srv.http_url}/v2/models/pagedserve/generate_stream",
                        {"text_input": PROMPT, "stream": True, "parameters": {"max_tokens": LONG_TOKENS, **GREEDY}})
        assert len(list(read_sse_events(sock, stop_after=3))) == 3
        sock.close()
        code, seconds = signal_and_time_exit(srv.proc, signal.SIGINT)
        took.append(round(seconds, 2))
        log = tail(srv.log_path)
        if "Signal (11) received" in srv.log_path.read_text(errors="replace"):
            crashed.append(len(took))
            assert seconds < DRAIN_TIMEOUT + STOP_GRACE_S + MARGIN, f"run {len(took)} (tritonserver crashed): " \
                                                                    f"exited {seconds:.1f} s after SIGINT ({took})\n{log}"
            continue
        assert code == 0, log
        assert seconds < DRAIN_TIMEOUT + MARGIN, f"run {len(took)}: exited {seconds:.1f} s after SIGINT ({took})\n{log}"
    print(f"exit seconds after SIGINT: {took}; runs where tritonserver crashed while unloading: {crashed}")


def test_the_launchers_default_drain_timeout_is_the_engines():
    from pagedserve.adapters.triton_server.launcher import DEFAULT_DRAIN_TIMEOUT_S
    from pagedserve.core.config import LimitsConfig

    assert DEFAULT_DRAIN_TIMEOUT_S == LimitsConfig().drain_timeout
