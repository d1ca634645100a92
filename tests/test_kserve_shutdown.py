"""Stopping `pagedserve kserve` the way a user and Kubernetes do (SIGTERM, or Ctrl-C's SIGINT), seen
from its clients: a REAL kserve ModelServer on a tiny random model, with the stock clients (raw
HTTP as curl -N for the OpenAI SSE streams, tritonclient.grpc for v2 ModelInfer).

* Four requests in flight, two OpenAI streams over HTTP and two v2 ModelInfer calls over gRPC, one
  short and one far longer than drain_timeout over each: the short ones finish in full, the long
  ones end with an error naming the drain period, every one within drain_timeout + 2 s of the
  signal, and the server exits by then too.
* An idle server exits within 2 s of SIGTERM and of SIGINT.
* A stream its client abandoned, then an immediate SIGINT: the server exits within drain_timeout +
  2 s, every time (20 servers in a row; slow).

The servers load tests/server_hooks (a fixed delay per step) through sitecustomize.py on their
PYTHONPATH, so the requests' lengths do not depend on machine speed.
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.harness.kserve_launch import start_kserve
from tests.kserve_server import ONE_THREAD
from tests.reliability_helpers import kserve_hooks_env
from tests.shutdown_helpers import (DRAIN_TIMEOUT, IDLE_EXIT_S, LONG_TOKENS, MARGIN, SHORT_TOKENS, STEP_DELAY,
                                    StreamEnd, consume_sse, kill_if_running, read_sse_events, signal_and_time_exit,
                                    assert_drained_in_time, sse_post, start_thread, tail)

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
PROMPT = "The paged KV cache hands out blocks"
ABANDONED_RUNS = 20


@pytest.fixture
def launch(tmp_path, tiny_model_dir):
    servers = []

    def make(delay: float = STEP_DELAY):
        srv = start_kserve(tiny_model_dir("llama"), tmp_path / f"server-{len(servers)}.log", MODEL,
                           args=("--dtype", "float32", "--max-model-len", str(LONG_TOKENS + 64),
                                 "--drain-timeout", str(DRAIN_TIMEOUT)),
                           env={**ONE_THREAD, **kserve_hooks_env(delay)}, timeout=240)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        if srv.proc.poll() is None:
            srv.stop()
        kill_if_running(srv.proc)


def _completion_body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True}


def _sse_stream(srv, name: str, max_tokens: int):
    end = StreamEnd(name)
    sock = sse_post(f"{srv.openai_url}/completions", _completion_body(max_tokens))
    first = json.loads(next(read_sse_events(sock, stop_after=1)))  # in flight before the signal
    assert first["choices"][0]["text"] is not None, first
    end.deltas = 1
    return end, start_thread(consume_sse, end, sock, lambda e: "error" in e,
                             lambda e: bool(e.get("choices")) and e["choices"][0].get("finish_reason") is not None)


def _grpc_infer(srv, name: str, max_tokens: int):
    """A v2 ModelInfer call on its own thread (it answers once, at the end)."""
    end = StreamEnd(name)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))

    def call() -> None:
        try:
            result = client.infer(MODEL, [text], parameters={
                "max_tokens": max_tokens, "sampling_parameters": json.dumps({"temperature": 0.0}), "ignore_eos": True},
                client_timeout=120)
            end.final = True
            end.deltas = len(result.as_numpy("text_output"))
        except InferenceServerException as exc:
            end.error = exc.message()
        finally:
            end.ended_at = time.monotonic()
            client.close()

    return end, start_thread(call)


def _running(srv) -> int:
    """Requests the engine runs, from /metrics."""
    import httpx

    for line in httpx.get(f"{srv.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pagedserve:num_requests_running{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_sigterm_drains_requests_over_both_protocols_and_ends_the_long_ones_with_an_error(launch):
    srv = launch()
    sse_short, t1 = _sse_stream(srv, "sse-short", SHORT_TOKENS)
    sse_long, t2 = _sse_stream(srv, "sse-long", LONG_TOKENS)
    grpc_short, t3 = _grpc_infer(srv, "grpc-short", SHORT_TOKENS)
    grpc_long, t4 = _grpc_infer(srv, "grpc-long", LONG_TOKENS)
    deadline = time.monotonic() + 30
    while _running(srv) < 4:  # all four in flight before the signal
        assert time.monotonic() < deadline, tail(srv.log_path)
        time.sleep(0.05)
    signalled = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    for t in (t1, t2, t3, t4):
        t.join(timeout=DRAIN_TIMEOUT + 30)
    code = srv.proc.wait(timeout=60)
    exited = time.monotonic() - signalled
    log = tail(srv.log_path, 60)
    ends = {e.name: e for e in (sse_short, sse_long, grpc_short, grpc_long)}
    assert ends["sse-short"].error is None and ends["sse-short"].final, (ends["sse-short"], log)
    assert ends["grpc-short"].error is None and ends["grpc-short"].final, (ends["grpc-short"], log)
    assert_drained_in_time(ends, signalled, code, exited, log)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_idle_server_exits_within_two_seconds(launch, sig):
    import httpx

    srv = launch(0.0)
    r = httpx.post(f"{srv.openai_url}/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200, r.text
    code, took = signal_and_time_exit(srv.proc, sig)
    assert code == 0, tail(srv.log_path)
    assert took < IDLE_EXIT_S, f"an idle server took {took:.1f} s to exit after {sig.name}\n{tail(srv.log_path)}"


@pytest.mark.slow
def test_an_abandoned_stream_then_sigint_exits_within_the_drain_period_every_time(launch):
    """`curl .../completions` once, then `curl -sN ... | head -3` (the client goes away mid-stream),
    then Ctrl-C at once, 20 times: the server exits within drain_timeout + 2 s every time."""
    import httpx

    took = []
    for _ in range(ABANDONED_RUNS):
        srv = launch()
        r = httpx.post(f"{srv.openai_url}/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        sock = sse_post(f"{srv.openai_url}/completions", _completion_body(LONG_TOKENS))
        assert len(list(read_sse_events(sock, stop_after=3))) == 3
        sock.close()
        code, seconds = signal_and_time_exit(srv.proc, signal.SIGINT)
        took.append(round(seconds, 2))
        assert code == 0, tail(srv.log_path)
        assert seconds < DRAIN_TIMEOUT + MARGIN, f"run {len(took)}: exited {seconds:.1f} s after SIGINT ({took})\n" \
                                                 f"{tail(srv.log_path)}"
