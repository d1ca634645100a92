"""Reliability under abuse and overload on a REAL kserve ModelServer (`pagedserve kserve` in a
subprocess), with the stock clients (openai SDK, httpx): a huge body or prompt is refused without
stalling other streams, a full queue answers 429 with Retry-After, X-Request-Timeout ends a request
with finish_reason "timeout", a failed step ends every stream with an error and the server
recovers, the API key guards the OpenAI routes, SIGTERM drains, a dead engine stops the server,
prompts never reach the log.

The servers load tests/server_hooks (slow steps, injected faults) through sitecustomize.py on
their PYTHONPATH, so timings do not depend on machine speed.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.harness.kserve_launch import start_kserve
from tests.harness import ONE_THREAD
from tests.kserve_server import engine_value, scrape
from tests.reliability_helpers import MARKER, assert_no_stall, kserve_hooks_env, largest_gap

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
API_KEY = "sk-test-1234"
PROMPT = f"The paged KV cache {MARKER} hands out blocks"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
STEP_DELAY = 0.02
LIMITS = ("--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--max-waiting-requests", "2")


def launch(tmp, model_dir, delay: float, *extra: str, api_key: str | None = API_KEY):
    fault_file = tmp / "fault"
    env = {**ONE_THREAD, **kserve_hooks_env(delay, fault_file)}
    if api_key:
        env["PAGEDSERVE_API_KEY"] = api_key  # the environment variable, as a Secret would set it
    srv = start_kserve(model_dir, tmp / "server.log", MODEL, args=(*LIMITS, *extra), env=env, timeout=180)
    return srv, fault_file


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    srv, fault_file = launch(tmp_path_factory.mktemp("kserve-rel"), tiny_model_dir("llama"), STEP_DELAY)
    yield srv, fault_file
    srv.stop()


@pytest.fixture
def fresh(tmp_path, tiny_model_dir):
    """A server of its own for tests that end it (drain) or break it (dead engine)."""
    servers = []

    def make(delay: float, *extra: str):
        srv, fault_file = launch(tmp_path, tiny_model_dir("llama"), delay, *extra, api_key=None)
        servers.append(srv)
        return srv, fault_file

    yield make
    for srv in servers:
        srv.stop()


def client(srv, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.openai_url, api_key=key, max_retries=0, timeout=120)


def metric(srv, name: str, **labels: str) -> float:
    return engine_value(scrape(srv.url), name, MODEL, **labels)


def stream_times(srv, max_tokens: int, beside=None) -> list[float]:
    """Arrival times of a streamed completion's deltas; `beside` runs after the third delta."""
    times, worker = [], None
    for chunk in client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                                stream=True, **GREEDY):
        if chunk.choices:  # one chunk per token (its text may be empty: a partial character)
            times.append(time.monotonic())
        if len(times) == 3 and beside is not None and worker is None:
            worker = threading.Thread(target=beside)
            worker.start()
    if worker is not None:
        worker.join()
    return times


def test_a_huge_body_or_prompt_is_refused_without_stalling_another_stream(served):
    srv, _ = served
    answers = {}

    def huge_requests():
        # 16 MB: over max_request_bytes (8 MiB), 413 before the body is parsed; 1 MB: under it
        # but far over what max_model_len=512 tokens can hold, 400 before tokenizing.
        for name, size in (("16MB", 16 * 2**20), ("1MB", 2**20)):
            try:
                client(srv).completions.create(model=MODEL, prompt="a" * size, max_tokens=4)
            except openai.APIStatusError as exc:
                answers[name] = (exc.status_code, exc.body, time.monotonic())

    def measure(with_huge: bool) -> float:
        answers.clear()
        times = stream_times(srv, 120, huge_requests if with_huge else None)
        assert len(times) == 120  # the same greedy stream, in full
        if with_huge:
            status, body, at = answers["16MB"]
            assert status == 413 and body["code"] == "request_too_large"
            assert "max_request_bytes=8388608" in body["message"]
            assert at < times[-1]  # refused while the stream was still running
            status, body, at = answers["1MB"]
            assert status == 400 and body["code"] == "context_length_exceeded" and "characters" in body["message"]
            assert at < times[-1]
        return largest_gap(times)

    assert_no_stall(measure)


def test_a_full_queue_answers_429_with_retry_after_and_counts_it(served):
    srv, _ = served
    before = metric(srv, "pagedserve:request_refused_total", reason="waiting_requests")
    def open_stream():
        return client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True, **GREEDY)

    def queued() -> None:  # the answer starts with the first delta: these block until admitted
        open_stream().close()

    streams = [open_stream() for _ in range(4)]  # max_num_seqs=4: all running
    waiters = [threading.Thread(target=queued) for _ in range(2)]  # max_waiting_requests=2: queued
    try:
        for w in waiters:
            w.start()
        deadline = time.monotonic() + 90
        while metric(srv, "pagedserve:num_requests_waiting") != 2:
            assert time.monotonic() < deadline, "the two extra requests never queued"
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as refused:  # the SDK's class for 429
            client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        v2 = httpx.post(f"{srv.url}/v2/models/{MODEL}/infer", timeout=30, json={
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}]})
        still_running = metric(srv, "pagedserve:num_requests_running")
    finally:
        for s in streams:
            s.close()
        for w in waiters:
            w.join(timeout=120)
    assert refused.value.status_code == 429 and refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "queue_full" and "max_waiting_requests=2" in refused.value.body["message"]
    assert v2.status_code == 429 and v2.headers["retry-after"] == "1" and "max_waiting_requests=2" in v2.text
    assert still_running == 4  # the refusals came while the long requests still ran
    assert metric(srv, "pagedserve:request_refused_total", reason="waiting_requests") == before + 2
    deadline = time.monotonic() + 15
    while metric(srv, "pagedserve:kv_cache_usage_perc") != 0:
        assert time.monotonic() < deadline, "KV blocks not freed after the clients closed their streams"
        time.sleep(0.05)


def test_x_request_timeout_ends_a_request_with_finish_reason_timeout(served):
    srv, _ = served
    before = metric(srv, "pagedserve:request_success_total", finished_reason="timeout")
    out = client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, **GREEDY,
                                         extra_headers={"X-Request-Timeout": "0.3"})  # 200 tokens take >= 4 s
    assert out.choices[0].finish_reason == "timeout" and 0 < out.usage.completion_tokens < 200
    chunks = list(client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True,
                                                 **GREEDY, extra_headers={"X-Request-Timeout": "0.3"}))
    assert chunks[-1].choices[0].finish_reason == "timeout" and len(chunks) < 200
    with pytest.raises(openai.BadRequestError, match="X-Request-Timeout='soon'"):
        client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                       extra_headers={"X-Request-Timeout": "soon"})
    assert metric(srv, "pagedserve:request_success_total", finished_reason="timeout") == before + 2


def test_a_failed_step_ends_every_stream_with_an_error_and_the_server_recovers(served, tiny_model_dir):
    srv, fault_file = served
    streams = [client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True, **GREEDY)
               for _ in range(3)]
    answer = {}

    def whole() -> None:
        try:
            client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, **GREEDY)
        except openai.APIStatusError as exc:
            answer["error"] = exc

    worker = threading.Thread(target=whole)
    errors = []
    try:
        iters = [iter(s) for s in streams]
        for it in iters:
            next(it)
        worker.start()
        deadline = time.monotonic() + 30
        while metric(srv, "pagedserve:num_requests_running") != 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        fault_file.write_text("raise once")
        for it in iters:  # every stream ends with an error event, none hangs
            with pytest.raises(openai.APIError) as exc:
                for _ in it:
                    pass
            errors.append(exc.value)
        worker.join(timeout=60)
    finally:
        for s in streams:
            s.close()
    assert all("injected fault" in e.message for e in errors), [e.message for e in errors]
    assert answer["error"].status_code == 500 and answer["error"].body["code"] == "engine_step_failed"
    assert not fault_file.exists()
    assert httpx.get(f"{srv.url}/v2/models/{MODEL}/ready", timeout=5).status_code == 200  # recovered
    assert metric(srv, "pagedserve:engine_step_failures_total") == 1
    oracle = LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32"}))
    want = oracle.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].text
    out = client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY)
    assert out.choices[0].text == want


def test_the_api_key_guards_the_openai_routes_only(served):
    srv, _ = served
    with pytest.raises(openai.AuthenticationError) as exc:
        client(srv, key="wrong").models.list()
    assert exc.value.status_code == 401 and exc.value.body["code"] == "invalid_api_key"
    no_key = httpx.post(f"{srv.openai_url}/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert no_key.status_code == 401 and no_key.headers["www-authenticate"] == "Bearer"
    assert [m.id for m in client(srv).models.list().data] == [MODEL]
    assert httpx.get(f"{srv.url}/v2/models/{MODEL}/ready", timeout=5).status_code == 200  # probes stay open


def test_prompts_never_reach_the_server_log(served):
    srv, _ = served
    with pytest.raises(openai.BadRequestError):  # errors are where prompts tend to leak
        client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    log = srv.log_path.read_text(errors="replace")
    assert "Registering model: tiny" in log and "400 Bad Request" in log  # the server's log, this request in it
    assert MARKER not in log


def _ready(srv) -> bool:
    try:
        return httpx.get(f"{srv.url}/v2/models/{MODEL}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_sigterm_lets_requests_finish_then_ends_the_rest_with_an_error(fresh):
    srv, _ = fresh(0.03, "--drain-timeout", "3")
    oai = client(srv, key="unused")
    short = iter(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stream=True, **GREEDY))
    long = iter(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True, **GREEDY))
    head = [next(short), next(long)]
    assert head[0].choices[0].text and head[1].choices[0].text
    signalled = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while _ready(srv):  # readiness false at once (uvicorn stops accepting; the model reports not ready)
        assert time.monotonic() < deadline, "still ready 5 s after SIGTERM"
        time.sleep(0.05)
    short_rest = list(short)  # in flight: finishes in full
    assert len(short_rest) == 29 and short_rest[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.APIError, match="drain period"):  # cut off when the 3 s period ends
        for _ in long:
            pass
    assert time.monotonic() - signalled < 10  # (400 tokens take at least 12 s)
    assert srv.proc.wait(timeout=60) == 0  # and the server exits by itself


def test_a_dead_engine_stops_the_server_so_the_platform_restarts_it(fresh):
    srv, fault_file = fresh(0.0)
    oai = client(srv, key="unused")
    for _ in range(3):  # three failed steps in a row: the engine gives up
        fault_file.write_text("raise once")
        with pytest.raises(openai.APIStatusError, match="injected fault"):
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert srv.proc.wait(timeout=60) == 1  # not ready, then exits non-zero: Kubernetes restarts the pod
    assert "the engine failed" in srv.log_path.read_text(errors="replace")
