"""The KServe adapter's pure translation pieces (no kserve import, no server): strict request
parsing, SamplingParams mapping, error mapping, response rendering and the metrics collector."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2

from pagedserve.adapters.engine_metrics import ENGINE_METRICS
from pagedserve.adapters.kserve.errors import OpenAIError, error_body, to_openai_error
from pagedserve.adapters.kserve.metrics import EngineMetricsCollector
from pagedserve.adapters.kserve.protocol import (ChatCompletionRequest, CompletionRequest, infer_params,
                                                 parse_request)
from pagedserve.adapters.kserve.responses import CompletionRenderer
from pagedserve.core.errors import EngineDead, InvalidRequest, RequestTooLong
from pagedserve.core.metrics import EngineMetrics
from pagedserve.core.outputs import RequestOutput


def parse(cls, body: dict):
    return parse_request(cls, json.dumps(body).encode())


def test_completion_defaults_and_vllm_extras_reach_sampling_params():
    req = parse(CompletionRequest, {"model": "m", "prompt": "hi", "stop": "\n", "top_k": 5, "min_p": 0.1,
                                    "repetition_penalty": 1.2, "stop_token_ids": [7], "ignore_eos": True,
                                    "seed": 3, "n": 2, "temperature": 0})
    p = req.sampling_params()
    assert (p.max_tokens, p.stop, p.top_k, p.min_p, p.repetition_penalty) == (16, ("\n",), 5, 0.1, 1.2)
    assert (p.stop_token_ids, p.ignore_eos, p.seed, p.n, p.greedy) == ((7,), True, 3, 2, True)
    assert p.logprobs is None and p.prompt_logprobs is None
    echo = parse(CompletionRequest, {"model": "m", "prompt": [1, 2], "echo": True, "logprobs": 2}).sampling_params()
    assert (echo.logprobs, echo.prompt_logprobs) == (2, 2)


# What vllm-router 0.1.17 forwards in place of the client's body (captured from the router itself):
# SGLang's fields at their defaults on every request, whatever the client sent.
ROUTER_COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": False, "echo": False,
                     "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}
ROUTER_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False, "max_tokens": 4,
               "logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True}


def test_the_fields_vllm_router_adds_are_accepted_at_its_defaults_and_change_nothing():
    plain = parse(CompletionRequest, {"model": "m", "prompt": "hi", "max_tokens": 4}).sampling_params()
    assert parse(CompletionRequest, ROUTER_COMPLETION).sampling_params() == plain
    plain_chat = parse(ChatCompletionRequest, {"model": "m", "messages": ROUTER_CHAT["messages"], "max_tokens": 4})
    assert parse(ChatCompletionRequest, ROUTER_CHAT).sampling_params() == plain_chat.sampling_params()
    # any value that asks for the missing behaviour is a 400 naming the field
    for cls, body, field, value in ((CompletionRequest, ROUTER_COMPLETION, "no_stop_trim", True),
                                    (CompletionRequest, ROUTER_COMPLETION, "return_hidden_states", True),
                                    (ChatCompletionRequest, ROUTER_CHAT, "continue_final_message", True),
                                    (ChatCompletionRequest, ROUTER_CHAT, "include_reasoning", False)):
        with pytest.raises(OpenAIError) as err:
            parse(cls, {**body, field: value}).sampling_params()
        assert err.value.status == 400 and err.value.param == field and field in err.value.message
    # separating reasoning is moot without a reasoning parser: both values accepted
    moot = {**ROUTER_CHAT, "separate_reasoning": False, "stream_reasoning": False}
    assert parse(ChatCompletionRequest, moot).sampling_params() == plain_chat.sampling_params()


def test_prompt_shapes():
    def prompts(p):
        return parse(CompletionRequest, {"model": "m", "prompt": p}).prompts()
    assert prompts("a") == ["a"] and prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"] and prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(OpenAIError, match="prompt is empty"):
        prompts([])


def test_chat_token_limits_and_logprobs():
    base = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    req = parse(ChatCompletionRequest, base)
    assert req.sampling_params().max_tokens is None  # OpenAI chat: up to the context
    assert req.messages[0].as_template_input() == {"role": "user", "content": "hi"}
    assert parse(ChatCompletionRequest, {**base, "max_completion_tokens": 5}).sampling_params().max_tokens == 5
    assert parse(ChatCompletionRequest, {**base, "logprobs": True}).sampling_params().logprobs == 0
    assert parse(ChatCompletionRequest, {**base, "logprobs": True, "top_logprobs": 4}).sampling_params().logprobs == 4
    with pytest.raises(OpenAIError, match="top_logprobs needs logprobs=true"):
        parse(ChatCompletionRequest, {**base, "top_logprobs": 4}).sampling_params()
    with pytest.raises(OpenAIError, match="not both"):
        parse(ChatCompletionRequest, {**base, "max_tokens": 3, "max_completion_tokens": 4}).sampling_params()


@pytest.mark.parametrize("body,param,needle", [
    ({"model": "m", "prompt": "x", "max_tokens": "3"}, "max_tokens", "valid integer"),
    ({"model": "m", "prompt": "x", "n": True}, "n", "valid integer"),
    ({"model": "m", "prompt": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "unknown or unsupported field"),
    ({"model": "m", "prompt": "x", "guided_choice": "yes"}, "guided_choice", "valid array"),
    ({"prompt": "x"}, "model", "required field is missing"),
    ({"model": "m", "prompt": 5}, "prompt", "prompt"),
])
def test_wrong_types_and_unknown_fields_name_the_field(body, param, needle):
    with pytest.raises(OpenAIError) as err:
        parse(CompletionRequest, body)
    assert err.value.status == 400 and err.value.param == param and needle in err.value.message


@pytest.mark.parametrize("fields", [{"best_of": 3}, {"best_of": 1, "n": 2}])
def test_best_of_is_one_rule_for_both_adapters(fields):
    """The Triton codec and the KServe routes hand best_of to SamplingParams.from_dict, so the same
    value gets the same answer (and the same message) on both platforms."""
    from pagedserve.adapters.triton_server.codec import sampling_params_from

    with pytest.raises(InvalidRequest) as triton:
        sampling_params_from(fields)
    with pytest.raises(InvalidRequest) as kserve:
        parse(CompletionRequest, {"model": "m", "prompt": "x", **fields}).sampling_params()
    assert triton.value.param == kserve.value.param == "best_of"
    assert str(triton.value) == str(kserve.value)
    for n in (1, 2):  # equal to n: nothing extra drawn, accepted by both
        assert sampling_params_from({"best_of": n, "n": n}).n == n
        assert parse(CompletionRequest, {"model": "m", "prompt": "x", "best_of": n, "n": n}).sampling_params().n == n


def test_malformed_json_and_out_of_range_values():
    with pytest.raises(OpenAIError, match="not valid JSON"):
        parse_request(CompletionRequest, b'{"model": ')
    with pytest.raises(InvalidRequest, match="temperature=-1.0 is out of range"):
        parse(CompletionRequest, {"model": "m", "prompt": "x", "temperature": -1}).sampling_params()


def test_error_mapping():
    cases = [(RequestTooLong("too long"), 400, "context_length_exceeded"), (InvalidRequest("bad"), 400, None),
             (EngineDead("dead"), 503, "engine_dead"), (RuntimeError("bug"), 500, None)]
    for exc, status, code in cases:
        err = to_openai_error(exc)
        assert (err.status, err.code) == (status, code)
        assert set(error_body(err)["error"]) == {"message", "type", "param", "code"}


def test_v2_parameters_from_rest_and_grpc():
    p, kw = infer_params({"max_tokens": 4, "binary_data_output": True,
                          "sampling_parameters": json.dumps({"temperature": 0.5, "stop": ["x"]})})
    assert (p.max_tokens, p.temperature, p.stop, kw) == (4, 0.5, ("x",), {"cache_salt": None})
    grpc = {"max_tokens": service_pb2.InferParameter(int64_param=3),
            "ignore_eos": service_pb2.InferParameter(bool_param=True),
            "cache_salt": service_pb2.InferParameter(string_param="tenant-a")}
    p, kw = infer_params(grpc)
    assert (p.max_tokens, p.ignore_eos, kw) == (3, True, {"cache_salt": "tenant-a"})
    assert infer_params({"sampling_parameters": '{"cache_salt": "b"}'})[1] == {"cache_salt": "b"}
    with pytest.raises(OpenAIError, match="'temperature' arrived without a value"):
        infer_params({"temperature": service_pb2.InferParameter()})
    with pytest.raises(OpenAIError, match="JSON object"):
        infer_params({"sampling_parameters": "[1]"})
    for bad in ("", 5):
        with pytest.raises(InvalidRequest, match="cache_salt") as exc:
            infer_params({"cache_salt": bad})
        assert exc.value.param == "cache_salt"


class _Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _out(rid, index, ids, text, finished, n_out, n_prompt=3, cached=0):
    return RequestOutput(rid, index, tuple(ids), text, finished, "length" if finished else None, None,
                         n_prompt, n_out, (1, 2, 3), num_cached_tokens=cached)


def test_renderer_indexes_choices_and_counts_usage_once_per_prompt():
    r = CompletionRenderer("cmpl-1", "m", _Tok().decode, n=2, want_logprobs=False, echo=True, prompts=["P0", [1, 2, 3]])
    # cached prompt tokens count once per prompt, as sample 0 reports them (samples 2..n reuse its blocks)
    chunks = [r.chunk(0, _out("a", 1, [5], "x", False, 1, cached=2)),
              r.chunk(1, _out("b", 0, [6], "y", True, 1, cached=1)),
              r.chunk(0, _out("a", 1, [7], "z", True, 2, cached=2)),
              r.chunk(0, _out("a", 0, [8], "w", True, 1, cached=2)),
              r.chunk(1, _out("b", 1, [9], "v", True, 1, cached=2))]
    assert [c["choices"][0]["index"] for c in chunks] == [1, 2, 1, 0, 3]
    assert chunks[0]["choices"][0]["text"] == "P0x"  # echo once, on a choice's first delta
    assert chunks[1]["choices"][0]["text"] == "<1><2><3>y"  # token-id prompts are decoded for echo
    body = r.body()
    assert [c["text"] for c in body["choices"]] == ["P0w", "P0xz", "<1><2><3>y", "<1><2><3>v"]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert r.usage_chunk()["choices"] == [] and r.usage_chunk()["usage"] == body["usage"]


def test_metrics_collector_exports_the_snapshot():
    metrics = EngineMetrics()
    metrics.observe_first_token(0.003)
    metrics.observe_finished("stop", 1.2)
    metrics.observe_finished("abort", 0.4)
    metrics.observe_refused("waiting_prompt_tokens")
    snap = metrics.snapshot()
    registry = CollectorRegistry()
    registry.register(EngineMetricsCollector(lambda: snap, "m", "7"))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    labels = (("model", "m"), ("version", "7"))
    for m in ENGINE_METRICS:
        suffix = "_count" if m.kind.value == "histogram" else ""
        assert (m.name + suffix, labels) in samples, m.name
    assert samples[("pagedserve:time_to_first_token_seconds_bucket", (("le", "0.005"), *labels))] == 1
    assert samples[("pagedserve:time_to_first_token_seconds_bucket", (("le", "0.001"), *labels))] == 0
    assert samples[("pagedserve:request_success_total", (("finished_reason", "abort"), *labels))] == 1
    refused = tuple(sorted((("reason", "waiting_prompt_tokens"), *labels)))
    assert samples[("pagedserve:request_refused_total", refused)] == 1
    empty = CollectorRegistry()
    empty.register(EngineMetricsCollector(lambda: None, "m", "7"))
    assert b"pagedserve" not in generate_latest(empty)


def test_openai_routes_answer_503_until_the_engine_is_warm():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedserve.adapters.kserve.openai_routes import OpenAIServing

    app = FastAPI()
    OpenAIServing("m", lambda: None).register(app)  # the engine is still loading
    client = TestClient(app)
    r = client.post("/openai/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
    assert client.post("/openai/v1/completions", json={"model": "x", "prompt": "hi"}).status_code == 404
    assert client.get("/openai/v1/models").json()["data"][0]["id"] == "m"
    # KServe's v1 readiness route: 503 (its client reads "not ready") until warm, 404 for another model
    r = client.get("/v1/models/m")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
    assert client.get("/v1/models/other").status_code == 404
