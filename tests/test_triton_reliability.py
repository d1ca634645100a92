"""Reliability under abuse and overload on a REAL tritonserver, with the stock clients: a huge
prompt is refused without stalling other streams, a full queue refuses at once, deadlines end
requests with finish_reason "timeout", a failed step ends every stream with an error and the
model recovers, SIGTERM drains (and stops an idle server in seconds), a dead engine unloads the
model, a crashed server's stub does not outlive stop(), prompts never reach the log.

The servers load tests/server_hooks (slow steps, injected faults) through the test repository's
model.py, so timings do not depend on machine speed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from pagedserve.adapters.triton_server.launcher import DEFAULT_REPOSITORY, start_server
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from bench.proctree import process_tree
from tests.harness.local_ports import free_ports
from tests.reliability_helpers import MARKER, assert_no_stall, install_triton_hooks, largest_gap
from tests.triton_helpers import GrpcStream, grpc_request, http_post, scrape, sse_events, text_inputs, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = f"The paged KV cache {MARKER} hands out blocks"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
STEP_DELAY = 0.02


def settings(model_dir, **extra):
    return {"model": str(model_dir), "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4,
            "num_kv_blocks": 256, "max_waiting_requests": 2, **extra}


def launch(tmp, engine_settings: dict, delay: float, explicit: bool = True):
    """A tritonserver serving the text model of a copy of the shipped repository, with the hooks;
    in explicit model-control mode, as `pagedserve triton` runs it, or else Triton's default (none:
    it loads every model of the repository, which holds only this one)."""
    repo = tmp / "model_repository"
    shutil.copytree(DEFAULT_REPOSITORY, repo)
    (repo / "pagedserve" / "1" / "engine.json").write_text(json.dumps(engine_settings))
    fault_file = tmp / "fault"
    install_triton_hooks(repo / "pagedserve", delay, fault_file)
    http, grpc, metrics = free_ports(3)
    srv = start_server(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                       models=["pagedserve"] if explicit else None,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                       log_path=tmp / "tritonserver.log", timeout=240)
    return srv, fault_file


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    srv, fault_file = launch(tmp_path_factory.mktemp("triton-rel"), settings(tiny_model_dir("llama")), STEP_DELAY)
    try:
        yield srv, fault_file
    finally:
        srv.stop()


@pytest.fixture
def fresh(tmp_path, tiny_model_dir):
    """A server of its own for tests that end it (drain) or break it (dead engine)."""
    servers = []

    def make(delay: float, explicit: bool = True, **extra):
        srv, fault_file = launch(tmp_path, settings(tiny_model_dir("llama"), **extra), delay, explicit)
        servers.append(srv)
        return srv, fault_file

    yield make
    for srv in servers:
        srv.stop()


def _stream(url: str, max_tokens: int, **flags) -> GrpcStream:
    s = GrpcStream(url)
    s.send("pagedserve", text_inputs(PROMPT, True, {"max_tokens": max_tokens, **GREEDY}, **flags))
    return s


def _stream_gaps(url: str, beside=None) -> tuple[float, float, int]:
    """(largest gap between the stream's deltas, when it ended, deltas) while `beside` runs."""
    s = _stream(url, 120)
    try:
        first = s.collect(stop_after=3)
        worker = threading.Thread(target=beside) if beside else None
        if worker:
            worker.start()
        rest = s.collect(timeout=120)
        if worker:
            worker.join()
    finally:
        s.close()
    assert first.error is None and rest.error is None and rest.finals[-1]
    times = first.times + rest.times
    return largest_gap(times), times[-1], len(times)


def test_a_huge_prompt_is_refused_without_stalling_another_stream(served):
    srv, _ = served
    url = f"http://{srv.http_url}/v2/models/pagedserve/generate"
    answers = {}

    def huge_requests():
        # 16 MB: over max_request_bytes (8 MiB), refused before the prompt is decoded; 1 MB: under
        # it but far over what max_model_len=512 tokens can hold, refused before tokenizing.
        for name, size in (("16MB", 16 * 2**20), ("1MB", 2**20)):
            answers[name] = (*http_post(url, {"text_input": "a" * size, "parameters": {"max_tokens": 4}}),
                             time.monotonic())

    def measure(with_huge: bool) -> float:
        answers.clear()
        gap, ended, n = _stream_gaps(srv.grpc_url, huge_requests if with_huge else None)
        assert n == 120
        if with_huge:
            status, body, at = answers["16MB"]
            assert status == 400 and "max_request_bytes=8388608" in json.loads(body)["error"]
            assert at < ended  # refused while the stream was still running
            status, body, at = answers["1MB"]
            assert status == 400 and "characters" in json.loads(body)["error"] and "max_model_len=512" in body
            assert at < ended
        return gap

    assert_no_stall(measure)


def test_a_full_queue_refuses_at_once_and_counts_it(served):
    srv, _ = served
    streams = [_stream(srv.grpc_url, 200) for _ in range(4)]  # max_num_seqs=4: all running
    try:
        assert wait_for(lambda: scrape(srv.metrics_url)["pagedserve:num_requests_running"] == 4, timeout=90), \
            (scrape(srv.metrics_url), [s.collect(stop_after=1).error for s in streams])
        streams += [_stream(srv.grpc_url, 200) for _ in range(2)]  # max_waiting_requests=2: queued
        assert wait_for(lambda: scrape(srv.metrics_url)["pagedserve:num_requests_waiting"] == 2, timeout=90)
        refused = grpc_request(srv.grpc_url, "pagedserve", text_inputs(PROMPT, True, {"max_tokens": 4}))
        status, body = http_post(f"http://{srv.http_url}/v2/models/pagedserve/generate",
                                 {"text_input": PROMPT, "parameters": {"max_tokens": 4}})
        still_running = scrape(srv.metrics_url)["pagedserve:num_requests_running"]
    finally:
        for s in streams:
            s.close(cancel=True)
    # Stream errors carry no status code in tritonclient, and Triton 2.51's /generate answers any
    # error a model sends with 400: the message is what tells a client to back off.
    assert refused.error is not None and not refused.responses
    assert "max_waiting_requests=2" in refused.error.message() and "retry later" in refused.error.message()
    assert status == 400 and "max_waiting_requests=2" in json.loads(body)["error"], body
    assert still_running == 4  # the refusals came while the long requests still ran
    key = "pagedserve:request_refused_total{reason=waiting_requests}"
    assert wait_for(lambda: scrape(srv.metrics_url).get(key) == 2, timeout=10)
    assert wait_for(lambda: scrape(srv.metrics_url)["pagedserve:kv_cache_usage_perc"] == 0, timeout=15)


def test_a_request_timeout_ends_it_with_finish_reason_timeout(served):
    srv, _ = served
    key = "pagedserve:request_success_total{finished_reason=timeout}"
    before = scrape(srv.metrics_url).get(key, 0.0)
    # tritonclient's own request timeout (microseconds), on a stream of up to 200 tokens (>= 4 s)
    s = GrpcStream(srv.grpc_url)
    try:
        s.client.async_stream_infer("pagedserve", text_inputs(PROMPT, True, {"max_tokens": 200, **GREEDY},
                                                              return_finish_reason=True),
                                    timeout=300_000, enable_empty_final_response=True)
        res = s.collect(timeout=60)
    finally:
        s.close()
    assert res.error is None and res.finals[-1]
    assert res.responses[-1][0].as_numpy("finish_reason")[0] == b"timeout"
    assert 0 < len(res.responses) < 200
    # a /generate body's "timeout" arrives as the request parameter of that name
    status, body = http_post(f"http://{srv.http_url}/v2/models/pagedserve/generate", {
        "text_input": PROMPT, "timeout": 300_000, "return_finish_reason": True, "exclude_input_in_output": True,
        "return_num_output_tokens": True, "parameters": {"max_tokens": 200, **GREEDY}})
    assert status == 200, body
    out = json.loads(body)
    assert out["finish_reason"] == "timeout" and 0 < out["num_output_tokens"] < 200
    status, body = http_post(f"http://{srv.http_url}/v2/models/pagedserve/generate",
                             {"text_input": PROMPT, "timeout": -5, "parameters": {"max_tokens": 2}})
    assert status == 400 and "timeout=-5" in json.loads(body)["error"]
    assert wait_for(lambda: scrape(srv.metrics_url).get(key, 0.0) == before + 2, timeout=10)
    assert wait_for(lambda: scrape(srv.metrics_url)["pagedserve:kv_cache_usage_perc"] == 0, timeout=15)


def test_a_failed_step_ends_every_stream_with_an_error_and_the_model_recovers(served, tiny_model_dir):
    srv, fault_file = served
    streams = [_stream(srv.grpc_url, 200) for _ in range(3)]
    answer = {}
    whole = threading.Thread(target=lambda: answer.update(r=http_post(
        f"http://{srv.http_url}/v2/models/pagedserve/generate",
        {"text_input": PROMPT, "parameters": {"max_tokens": 200, **GREEDY}})))
    try:
        whole.start()
        for s in streams:
            got = s.collect(stop_after=2)
            assert len(got.responses) == 2, got.error.message()
        assert wait_for(lambda: scrape(srv.metrics_url)["pagedserve:num_requests_running"] == 4, timeout=30)
        fault_file.write_text("raise once")
        ended = [s.collect(timeout=60) for s in streams]
        whole.join(timeout=60)
    finally:
        for s in streams:
            s.close()
    for res in ended:  # every stream ends, with an error naming the cause, none hangs
        assert res.error is not None and "injected fault" in res.error.message()
    status, body = answer["r"]  # the non-streaming one too (Triton 2.51's /generate: 400 for any model error)
    assert status == 400 and "injected fault" in json.loads(body)["error"]
    assert not fault_file.exists()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert client.is_model_ready("pagedserve")  # recovered: still ready
    finally:
        client.close()
    assert wait_for(lambda: scrape(srv.metrics_url).get("pagedserve:engine_step_failures_total") == 1, timeout=10)
    oracle = LLMEngine(EngineConfig.from_dict(settings(tiny_model_dir("llama"))))
    want = oracle.generate([PROMPT], SamplingParams(max_tokens=16, **GREEDY))[0].text
    res = grpc_request(srv.grpc_url, "pagedserve", text_inputs(PROMPT, False, {"max_tokens": 16, **GREEDY},
                                                              exclude_input_in_output=True))
    assert res.error is None and res.texts() == [want]
    assert wait_for(lambda: scrape(srv.metrics_url)["pagedserve:kv_cache_usage_perc"] == 0, timeout=15)


def test_prompts_never_reach_the_server_log(served):
    srv, _ = served
    # one more failing request carrying the marker (errors are where prompts tend to leak)
    status, _ = http_post(f"http://{srv.http_url}/v2/models/pagedserve/generate",
                          {"text_input": PROMPT, "parameters": {"max_tokens": -1}})
    assert status == 400
    log = srv.log_path.read_text(errors="replace")
    assert "successfully loaded 'pagedserve'" in log  # the log is the server's
    assert MARKER not in log


def _http_ready(srv) -> bool:
    try:
        with urllib.request.urlopen(f"http://{srv.http_url}/v2/health/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_sigterm_lets_requests_finish_then_ends_the_rest_with_an_error(fresh):
    # Triton's own shutdown: on SIGTERM it closes its HTTP port (readiness fails at once) and waits
    # (up to --exit-timeout-secs) for the open HTTP connections; then it unloads the model, whose
    # finalize() gives the requests still running drain_timeout and ends the rest with UNAVAILABLE.
    srv, _ = fresh(0.03, drain_timeout=3.0, max_model_len=1100)
    short = _stream(srv.grpc_url, 30)  # about 1 s: finishes within the drain period
    long = _stream(srv.grpc_url, 1000)  # about 30 s: cut off when the 3 s period ends
    sse = urllib.request.urlopen(urllib.request.Request(
        f"http://{srv.http_url}/v2/models/pagedserve/generate_stream",
        data=json.dumps({"text_input": PROMPT, "stream": True,
                         "parameters": {"max_tokens": 40, **GREEDY}}).encode()), timeout=60)
    try:
        head = [short.collect(stop_after=2), long.collect(stop_after=2)]
        assert sse.readline().startswith(b"data: ")
        signalled = time.monotonic()
        srv.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: not _http_ready(srv), timeout=5)  # readiness false at once
        sse_body = sse.read().decode()
        short_rest = short.collect(timeout=60)
        short.close()  # an open gRPC stream, even an idle one, holds up Triton's unload of the model
        long_rest = long.collect(timeout=60)
        long_ended = time.monotonic()
        long.close()
    finally:
        short.close()
        long.close()
        sse.close()
    assert short_rest.error is None and short_rest.finals[-1]  # in flight: finished in full
    assert len(head[0].responses) + len(short_rest.responses) == 30
    events = sse_events(sse_body)  # the open SSE stream, too
    assert len(events) == 39 and all("error" not in e for e in events)  # (after the one read above)
    assert long_rest.error is not None and "drain period" in long_rest.error.message()
    assert len(head[1].responses) + len(long_rest.responses) < 1000
    assert long_ended - signalled < 20  # cut off after the period, long before its 1000 tokens
    assert srv.process.wait(timeout=60) == 0  # and the server exits by itself
    assert "Fatal Python error" not in srv.log_path.read_text(errors="replace")  # the stub did not crash


IDLE_EXIT_S = 5.0
"""SIGTERM to exit of an idle server. Triton's own steps take about 2 s (a 1 s stub health check
before finalize(), then it polls the unload once a second): 2.3-2.9 s here, quiet or beside four
busy processes. The stub's exit used to add a segfault report (seen after structured-output
requests: 3.7 s quiet, 7.8 s beside the busy processes); exiting cleanly through the interpreter's
teardown instead takes 5-7 s there."""


def test_sigterm_on_an_idle_server_ends_it_in_seconds_and_cleanly(fresh):
    srv, _ = fresh(0.0)
    res = grpc_request(srv.grpc_url, "pagedserve", text_inputs(PROMPT, False, {"max_tokens": 4, **GREEDY}))
    assert res.error is None and res.finals == [True]
    signalled = time.monotonic()
    srv.process.send_signal(signal.SIGTERM)
    assert srv.process.wait(timeout=60) == 0
    took = time.monotonic() - signalled
    log = srv.log_path.read_text(errors="replace")
    assert "successfully unloaded 'pagedserve'" in log
    # The stub segfaulted on every unload, deleting its metric families after its channel to Triton
    # was gone; the test hooks' faulthandler reports such a crash as "Fatal Python error".
    assert "Fatal Python error" not in log and "Segfault" not in log, log[-1500:]
    assert took < IDLE_EXIT_S, f"an idle server took {took:.1f} s to stop after SIGTERM"


def test_stop_ends_the_stub_of_a_server_that_crashed(fresh):
    """A server that dies without unloading its model (SIGKILL here, a crash in life) cannot end its
    Python backend stub, and a stub that misses its parent's death (stopped here, as a hung one
    would be) runs on. stop() ends the server's whole session: nothing of its tree is left."""
    srv, _ = fresh(0.0)
    tree = process_tree(srv.process.pid)
    stubs = [pid for pid, name in tree if name == "triton_python_b"]
    assert stubs, tree
    try:
        for pid in stubs:
            os.kill(pid, signal.SIGSTOP)
        srv.process.kill()
        srv.process.wait(timeout=30)
        srv.stop()
        assert [(pid, name) for pid, name in tree if running_as(pid, name)] == []
    finally:
        for pid, name in tree:
            if running_as(pid, name):
                os.kill(pid, signal.SIGKILL)


def running_as(pid: int, name: str) -> bool:
    """Whether `pid` is still the live process `name` (not a zombie, not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
    except FileNotFoundError:
        return False
    return comm == name and rest.split()[0] != "Z"


def test_a_dead_engine_unloads_the_model(fresh):
    srv, fault_file = fresh(0.0)
    for _ in range(3):  # three failed steps in a row: the engine gives up
        fault_file.write_text("raise once")
        res = grpc_request(srv.grpc_url, "pagedserve", text_inputs(PROMPT, False, {"max_tokens": 4}))
        assert res.error is not None and "injected fault" in res.error.message()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert wait_for(lambda: not client.is_model_ready("pagedserve"), timeout=30)
    finally:
        client.close()
    res = grpc_request(srv.grpc_url, "pagedserve", text_inputs(PROMPT, False, {"max_tokens": 4}))
    assert res.error is not None and not res.responses


def test_a_dead_engine_outside_explicit_mode_keeps_the_server_up_and_says_why(fresh):
    """Outside explicit model-control mode the model cannot unload itself (the call would fail, and
    a failing call to Triton can crash the stub and the server with it): requests get an error, the
    server keeps serving, and the log says why the model still reports ready."""
    srv, fault_file = fresh(0.0, explicit=False)
    for _ in range(3):
        fault_file.write_text("raise once")
        res = grpc_request(srv.grpc_url, "pagedserve", text_inputs(PROMPT, False, {"max_tokens": 4}))
        assert res.error is not None and "injected fault" in res.error.message()
    assert wait_for(lambda: "not in explicit model-control mode" in srv.log_path.read_text(errors="replace"),
                    timeout=30)
    res = grpc_request(srv.grpc_url, "pagedserve", text_inputs(PROMPT, False, {"max_tokens": 4}))
    assert res.error is not None and not res.responses
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert client.is_server_live() and client.is_model_ready("pagedserve")
    finally:
        client.close()
    log = srv.log_path.read_text(errors="replace")
    assert srv.process.poll() is None and "could not unload" not in log and "Fatal Python error" not in log


def test_bad_timeout_parameter_type_is_named():
    from pagedserve.adapters.triton_server.codec import timeout_seconds
    from pagedserve.core.errors import InvalidRequest

    assert timeout_seconds(2_500_000, None) == 2.5
    assert timeout_seconds(0, '{"timeout": 1000000, "max_tokens": 4}') == 1.0
    assert timeout_seconds(0, '{"max_tokens": 4}') is None
    with pytest.raises(InvalidRequest, match="timeout='5'"):
        timeout_seconds(0, '{"timeout": "5"}')
    assert np.isclose(timeout_seconds(1, None), 1e-6)
