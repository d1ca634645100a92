"""Fast checks of the Triton adapter without a server: the codecs, the histogram replay, and
TritonPythonModel driven through a fake `triton_python_backend_utils` (removed again afterwards,
so other tests never see it). The real-server tests (test_triton_server.py) are the main proof."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import types

import numpy as np
import pytest

from pagedserve.adapters.triton_server.codec import TextRequest, TextResponseBuilder, parse_text_request
from pagedserve.adapters.triton_server.contracts import (ALL_INPUTS, TEXT, TOKENS, contract_from_config, parse_request,
                                                         select_contract)
from pagedserve.adapters.triton_server.token_codec import TokenRequest
from pagedserve.adapters.triton_server.metrics import replay_observations
from pagedserve.adapters.triton_server.token_codec import parse_token_request
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.metrics import TTFT_BUCKETS, Histogram
from pagedserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def t(value, dtype=None):
    return np.array([value], dtype=dtype)


# -- codecs ----------------------------------------------------------------------------------------
def test_text_request_from_vllm_backend_style_strings_and_parameters():
    req = parse_text_request({"text_input": t(b"hi", object), "sampling_parameters": t(json.dumps(
        {"temperature": "0.5", "max_tokens": "7", "ignore_eos": "true", "stop": ["x"]}).encode(), object)}, None)
    assert req.prompt == "hi" and req.params == SamplingParams(temperature=0.5, max_tokens=7, ignore_eos=True,
                                                               stop=("x",))
    # No sampling_parameters tensor: request parameters are used; input names there act as inputs and
    # Triton's own triton_* keys are not sampling keys.
    params = json.dumps({"max_tokens": 3, "stream": True, "return_finish_reason": True,
                         "triton_enable_empty_final_response": True})
    req = parse_text_request({"text_input": t(b"hi", object)}, params)
    assert req.stream and req.returns == {"return_finish_reason"} and req.params.max_tokens == 3


@pytest.mark.parametrize("tensors, params, message", [
    ({}, None, "text_input is missing"),
    ({"text_input": t(b"\xffa", object)}, None, "not valid UTF-8 (byte 0xff at position 0)"),
    ({"text_input": t(b"a", object), "sampling_parameters": t(b"[1]", object)}, None, "must be a JSON object"),
    ({"text_input": t(b"a", object), "sampling_parameters": t(b"{", object)}, None, "not valid JSON"),
    ({"text_input": t(b"a", object)}, '{"max_tokens": "many"}', "max_tokens='many' is not a number"),
    ({"text_input": t(b"a", object)}, '{"top_k": 3, "topp": 1}', "topp"),
    ({"text_input": t(b"a", object)}, '{"best_of": 3}', "best_of=3 is not supported"),
    ({"text_input": t(b"a", object), "stream": t("yes", object)}, None, "stream: expected true or false"),
])
def test_text_request_errors_name_the_problem(tensors, params, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_text_request(tensors, params)


def test_cumulative_logprob_without_logprobs_asks_engine_for_sampled_token_only():
    req = parse_text_request({"text_input": t(b"a", object), "return_cumulative_logprob": t(True)}, None)
    assert req.params.logprobs == 0 and not req.client_logprobs


def test_token_request_is_greedy_unless_sampling_is_asked():
    ids = np.array([5, 6, 7], dtype=np.int32)
    req = parse_token_request({"input_ids": ids, "request_output_len": t(4, np.int32)})
    assert req.prompt_ids == [5, 6, 7] and req.params.greedy and req.params.max_tokens == 4
    req = parse_token_request({"input_ids": ids, "request_output_len": t(4, np.int32),
                               "runtime_top_k": t(5, np.int32), "temperature": t(0.7, np.float32),
                               "end_id": t(9, np.int32), "random_seed": t(3, np.uint64)})
    assert req.params.top_k == 5 and req.params.temperature == pytest.approx(0.7) and req.params.seed == 3
    assert req.params.stop_token_ids == (9,) and req.params.ignore_eos
    with pytest.raises(InvalidRequest, match="request_output_len is missing"):
        parse_token_request({"input_ids": ids})


def test_one_model_both_contracts_the_request_says_which():
    ids = np.array([5, 6, 7], dtype=np.int32)
    text = parse_request({"text_input": t(b"hi", object), "temperature": t(0.0, np.float32)}, '{"max_tokens": 3}')
    assert isinstance(text, TextRequest) and text.params.temperature == 0.0 and text.params.max_tokens == 3
    tokens = parse_request({"input_ids": ids, "request_output_len": t(4, np.int32),
                            "exclude_input_in_output": t(True)}, None)
    assert isinstance(tokens, TokenRequest) and tokens.prompt_ids == [5, 6, 7] and tokens.exclude_input_in_output
    assert parse_request({"input_ids": ids, "request_output_len": t(4, np.int32)}, None, "tokens").params.max_tokens == 4
    assert set(ALL_INPUTS) >= {"text_input", "sampling_parameters", "input_ids", "request_output_len", "streaming"}
    assert set(ALL_INPUTS) == set(TEXT.inputs) | set(TOKENS.inputs)  # each contract owns its inputs
    assert select_contract({"text_input": t(b"hi", object)}) is TEXT and select_contract({"input_ids": ids}) is TOKENS
    assert select_contract({}, "tokens") is TOKENS  # restricted: its own parser names the missing input
    assert contract_from_config({}) == "auto"
    assert contract_from_config({"parameters": {"contract": {"string_value": "tokens"}}}) == "tokens"


@pytest.mark.parametrize("tensors, params, contract, message", [
    ({}, None, "auto", "no prompt: send text_input"),
    ({"text_input": t(b"a", object), "input_ids": t(1, np.int32)}, None, "auto", "not both"),
    ({"text_input": t(b"a", object), "random_seed": t(1, np.uint64)}, None, "auto", "random_seed: token-contract"),
    ({"text_input": t(b"a", object), "stop": t(True)}, None, "auto", "stop: token-contract"),
    ({"input_ids": t(1, np.int32), "request_output_len": t(2, np.int32), "stream": t(True)}, None, "auto",
     "stream: text-contract"),
    ({"text_input": t(b"a", object), "temperature": t(0.0, np.float32)}, '{"temperature": 1}', "auto",
     "temperature is given twice"),
    ({"text_input": t(b"a", object)}, None, "tokens", "token contract only"),
    ({"input_ids": t(1, np.int32), "request_output_len": t(2, np.int32)}, None, "text", "text contract only"),
    ({}, None, "text", "text_input is missing"),
])
def test_mixing_contracts_is_an_error_naming_the_input(tensors, params, contract, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request(tensors, params, contract)


def test_streaming_n2_response_has_one_element_per_sequence():
    from pagedserve.core.outputs import RequestOutput

    req = TextRequest("p", SamplingParams(n=2), stream=True, returns=frozenset({"return_num_output_tokens"}))
    b = TextResponseBuilder(req, str)
    out = RequestOutput("r", 1, (4,), "x", False, None, None, 1, 1, (1,))
    got = b.add(out)
    assert got["text_output"].tolist() == [b"", b"x"] and got["num_output_tokens"].tolist() == [0, 1]


# -- histogram replay ------------------------------------------------------------------------------
def test_replay_reproduces_bucket_counts_and_sum():
    rng = random.Random(0)
    prev = Histogram(TTFT_BUCKETS)
    for _ in range(50):
        prev.observe(rng.expovariate(5))
    cur = prev.copy()
    for v in [rng.expovariate(2) for _ in range(200)] + [0.005, 3000.0]:  # a bound, and +Inf
        cur.observe(v)
    replayed = Histogram(TTFT_BUCKETS)
    values = replay_observations(prev, cur)
    for v in values:
        replayed.observe(v)
    assert [c - p for c, p in zip(cur.counts, prev.counts)] == replayed.counts
    assert sum(values) == pytest.approx(cur.sum - prev.sum, rel=1e-9)
    assert replay_observations(cur, cur) == []


# -- TritonPythonModel with a fake pb_utils -------------------------------------------------------
class FakeTensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class FakeError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, msg, code=1):
        self.msg, self.code = msg, code

    def message(self):
        return self.msg


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {x.name: x.array for x in output_tensors}
        self.error = error


class FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

    def set(self, v):
        self.value = v

    def increment(self, v):
        self.value += v

    def observe(self, v):
        self.observed.append(v)


class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = range(3)
    created: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.created[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
        self.metrics.append(FakeMetric(labels, buckets))
        return self.metrics[-1]


class FakeSender:
    def __init__(self, cancel_after=None):
        self.sent, self.cancel_after, self.done = [], cancel_after, threading.Event()

    def send(self, response, flags=0):
        self.sent.append((response, flags))
        if flags == 1:
            self.done.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after


class FakeRequest:
    def __init__(self, inputs, parameters="{}", sender=None):
        self.inputs, self._parameters, self.sender = inputs, parameters, sender or FakeSender()

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return ""

    def parameters(self):
        return self._parameters


def fake_pb_utils():
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor, m.InferenceResponse, m.TritonError, m.MetricFamily = FakeTensor, FakeResponse, FakeError, FakeFamily
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    m.get_input_tensor_by_name = lambda req, name: (FakeTensor(name, req.inputs[name]) if name in req.inputs
                                                    else None)
    m.using_decoupled_model_transaction_policy = lambda cfg: cfg["model_transaction_policy"]["decoupled"]
    return m


@pytest.fixture
def model(request, monkeypatch, tmp_path, tiny_model_dir):
    """The model, restricted to the text contract unless a test asks for another (indirect param)."""
    contract = getattr(request, "param", "text")
    name = "pagedserve.adapters.triton_server.model"
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    monkeypatch.delitem(sys.modules, name, raising=False)
    import importlib
    import pagedserve.adapters.triton_server as package
    module = importlib.import_module(name)
    monkeypatch.setattr(module, "CANCEL_POLL_S", 0.0)  # poll on every delta: deterministic cancellation
    (tmp_path / "1").mkdir()
    settings = {"model": str(tiny_model_dir("llama")), "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128}
    (tmp_path / "1" / "engine.json").write_text(json.dumps(settings))
    instance = module.TritonPythonModel()
    config = {"model_transaction_policy": {"decoupled": True}, "parameters": {"contract": {"string_value": contract}}}
    instance.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path),
                         "model_version": "1", "model_name": "pagedserve"})
    try:
        yield instance
    finally:
        instance.finalize()
        assert instance._watcher.done() and instance._watcher.exception() is None  # stopped, not destroyed
        sys.modules.pop(name, None)  # the module holds the fake: never leave it importable
        if hasattr(package, "model"):
            delattr(package, "model")


def run(model, requests, timeout=30):
    assert model.execute(requests) is None  # execute hands off and returns at once
    for r in requests:
        assert r.sender.done.wait(timeout)
    return [r.sender.sent for r in requests]


def _hold_before_last_token(engine, max_tokens: int) -> None:
    """While a request asking for `max_tokens` has all its tokens but the last, the engine steps no
    further (it only takes commands): such a request can end by an abort alone, however late the
    cancel lands. Run free, the tiny model's steps finished it first on a busy machine."""
    inner = engine._engine
    real_step = inner.step

    def held_step():
        if any(r.max_tokens == max_tokens and r.num_output_tokens >= max_tokens - 1
               for r in list(inner.scheduler.samples.values())):
            time.sleep(0.001)
            return []
        return real_step()

    inner.step = held_step


def test_model_streams_with_one_final_and_errors_and_cancels(model, tmp_path):
    _hold_before_last_token(model.engine, 100)  # the cancelled request's
    sp = lambda **kw: np.array([json.dumps({"temperature": 0, "ignore_eos": True, **kw}).encode()], dtype=object)
    ok = FakeRequest({"text_input": t(b"abc", object), "stream": t(True), "sampling_parameters": sp(max_tokens=5)})
    bad = FakeRequest({"text_input": t(b"abc", object), "sampling_parameters": sp(max_tokens=0)})
    too_long = FakeRequest({"text_input": t(b"abc " * 200, object)})
    cancelled = FakeRequest({"text_input": t(b"abc", object), "stream": t(True),
                             "sampling_parameters": sp(max_tokens=100)}, sender=FakeSender(cancel_after=2))
    sent_ok, sent_bad, sent_long, sent_cancel = run(model, [ok, bad, too_long, cancelled])
    assert [f for _, f in sent_ok] == [0, 0, 0, 0, 1] and all(r.error is None for r, _ in sent_ok)
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine
    oracle = LLMEngine(EngineConfig.from_json_file(tmp_path / "1" / "engine.json"))  # the model's own settings
    expected = oracle.generate(["abc"], SamplingParams(temperature=0, ignore_eos=True, max_tokens=5))
    assert "".join(r.outputs["text_output"][0].decode() for r, _ in sent_ok) == expected[0].text
    for sent, code, text in ((sent_bad, FakeError.INVALID_ARG, "max_tokens"),
                             (sent_long, FakeError.INVALID_ARG, "max_model_len")):
        assert len(sent) == 1 and sent[0][1] == 1 and sent[0][0].error.code == code and text in sent[0][0].error.msg
    assert [f for _, f in sent_cancel] == [0, 0, 1] and sent_cancel[-1][0].error.code == FakeError.CANCELLED
    # The CANCELLED response goes out as the abort is queued; the engine thread frees the blocks
    # when it takes the command, a moment later.
    deadline = time.monotonic() + 10
    while model.engine.metrics.kv_cache_usage_perc != 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    model.metrics.refresh()
    assert model.engine.metrics.kv_cache_usage_perc == 0.0
    success = FakeFamily.created["pagedserve:request_success_total"].metrics
    assert {m.labels["finished_reason"]: m.value for m in success} == {"length": 1, "abort": 1}


@pytest.mark.parametrize("model", ["auto"], indirect=True)
def test_one_model_serves_each_contract_through_its_own_object(model, tmp_path):
    """Text and token requests side by side on one model; each is answered in its own contract's
    outputs, and TensorRT-LLM's `stop` is answered without running the engine."""
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine

    ids = [5, 9, 33, 2, 71]
    sp = np.array([json.dumps({"temperature": 0, "ignore_eos": True, "max_tokens": 4}).encode()], dtype=object)
    text = FakeRequest({"text_input": t(b"abc", object), "sampling_parameters": sp, "exclude_input_in_output": t(True)})
    tokens = FakeRequest({"input_ids": np.array(ids, dtype=np.int32), "request_output_len": t(4, np.int32),
                          "streaming": t(True)})
    stop = FakeRequest({"input_ids": np.array(ids, dtype=np.int32), "request_output_len": t(4, np.int32),
                        "stop": t(True)})
    sent_text, sent_tokens, sent_stop = run(model, [text, tokens, stop])
    oracle = LLMEngine(EngineConfig.from_json_file(tmp_path / "1" / "engine.json"))
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    expected_text, expected_ids = oracle.generate(["abc", ids], greedy)
    (response, flags), = sent_text
    assert flags == 1 and set(response.outputs) == {"text_output"}
    assert response.outputs["text_output"].tolist() == [expected_text.text.encode()]
    assert [f for _, f in sent_tokens][-1] == 1 and all(set(r.outputs) == {"output_ids", "sequence_length"}
                                                        for r, _ in sent_tokens)
    assert [i for r, _ in sent_tokens for i in r.outputs["output_ids"][0].tolist()] == list(expected_ids.token_ids)
    (response, flags), = sent_stop  # one FINAL response holding the prompt alone: nothing generated
    assert flags == 1 and response.outputs["output_ids"].tolist() == [ids]
    assert response.outputs["sequence_length"].tolist() == [len(ids)]
    # the engine saw "abc" and one token prompt, never `stop`'s
    assert model.engine.metrics.prompt_tokens_total == len(oracle.tokenize("abc")) + len(ids)


def test_stopping_the_metrics_releases_every_family_and_metric():
    """finalize() stops the metrics, which must let go of every pb_utils family and metric then: the
    stub deletes each through its channel to Triton, and one left to the interpreter's teardown is
    deleted after that channel is gone (the stub segfaulted so on every unload). Late refreshes and
    pokes (a request ending as the model unloads) do nothing."""
    import weakref

    from pagedserve.adapters.triton_server.metrics import TritonEngineMetrics
    from pagedserve.core.metrics import EngineMetrics

    engine = EngineMetrics()
    engine.observe_finished("length", 0.5)  # a labelled counter's metric, created on refresh
    FakeFamily.created.clear()
    metrics = TritonEngineMetrics(fake_pb_utils(), engine.snapshot, {"model": "m", "version": "1"}, interval=0.01,
                                  cache_config={"block_size": "16", "num_gpu_blocks": "8"})
    metrics.refresh()
    families = FakeFamily.created
    assert families["pagedserve:request_success_total"].metrics  # the labelled counter's metric too
    assert families["vllm:request_success_total"].metrics and families["vllm:cache_config_info"].metrics  # vLLM's
    created = [weakref.ref(x) for family in families.values() for x in (family, *family.metrics)]
    families.clear()  # the fake's own registry; nothing in the stub keeps one
    metrics.stop()
    assert [ref() for ref in created if ref() is not None] == []
    metrics.poke()
    metrics.refresh()


# -- launcher ------------------------------------------------------------------------------------
def test_backend_dir_holds_symlinks_and_env_finds_this_python(tmp_path):
    import sysconfig
    from pathlib import Path

    from pagedserve.adapters.triton_server.launcher import make_backend_dir, server_env, wheel_dir

    make_backend_dir(tmp_path)
    links = sorted((tmp_path / "python").iterdir())
    assert [p.name for p in links] == ["libtriton_python.so", "triton_python_backend_stub",
                                       "triton_python_backend_utils.py"]
    for link in links:  # symlinks, not copies: a copied stub hangs the model load
        assert link.is_symlink() and link.resolve().is_relative_to(wheel_dir()) and link.resolve().is_file()
    env = server_env({"PATH": "/usr/bin"}, model_override="/models/x")
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert sysconfig.get_config_var("LIBDIR") in env["LD_LIBRARY_PATH"].split(":")
    assert env["PAGEDSERVE_TRITON_MODEL"] == "/models/x"


def test_launcher_names_a_missing_repository(tmp_path):
    from pagedserve.tools.cli import main

    with pytest.raises(SystemExit, match="does not exist; pass --model-repository"):
        main(["triton", "--model-repository", str(tmp_path / "nope"), "--http-port", "1"])


@pytest.mark.parametrize("content, message", [
    (None, "engine config file not found"),
    ("{", "not valid JSON"),
    ('{"model": "default", "max_num_seqs": 0}', "max_num_seqs"),
    ('{"model": "default", "kv_cache_dtype": "int4"}', "kv_cache_dtype='int4'"),
])
def test_engine_json_errors_name_file_and_key(tmp_path, content, message):
    from pagedserve.adapters.triton_server.engine_config import load_engine_config
    from pagedserve.core.errors import ConfigError

    path = tmp_path / "engine.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        load_engine_config(path)
    assert str(path) in str(info.value)
    if content is None:
        return
    path.write_text('{"model": "default", "block_size": 32}')
    assert load_engine_config(path, model_override="/m").model.model == "/m"
