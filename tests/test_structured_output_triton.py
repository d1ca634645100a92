"""Structured outputs through a REAL tritonserver serving the embedded SmolLM2 on both contracts,
queried with the stock clients (tritonclient.grpc, plain HTTP). Judges: jsonschema, Python's re,
the choice list; unconstrained outputs are compared with the engine run in-process alone."""

from __future__ import annotations

import json
import queue
import re

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.harness.triton_launch import start_triton_on
from tests.triton_helpers import grpc_request, http_post, text_inputs, token_inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SETTINGS = {"model": "default", "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 64,
            "kv_cache_memory": 384 * 2**20}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
PHONE = r"\d{3}-\d{3}-\d{4}"
ANSWERS = ["yes", "no", "it depends"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The shipped repository: one model serving both contracts.
    srv = start_triton_on(tmp_path_factory.mktemp("so-triton"), SETTINGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle():
    return LLMEngine(EngineConfig.from_dict(SETTINGS))


def chat(oracle, text: str) -> str:
    return oracle.apply_chat_template([{"role": "user", "content": text}])


def text_of(result) -> str:
    assert result.error is None, result.error
    return "".join(t for t in result.texts())


def finish_reason(result) -> str:
    return result.responses[-1][0].as_numpy("finish_reason")[0].decode()


def test_grpc_stream_json_schema_and_vllm_backend_spellings(server, oracle):
    prompt = chat(oracle, "Invent a person with a name and an age.")
    sampling = {"max_tokens": 80, "temperature": 0, "guided_json": PERSON}
    streamed = grpc_request(server.grpc_url, "pagedserve", text_inputs(prompt, True, sampling,
                                                                       return_finish_reason=True))
    jsonschema.validate(json.loads(text_of(streamed)), PERSON)
    assert finish_reason(streamed) == "stop" and len(streamed.responses) > 2
    # vllm_backend sends structured_outputs as a JSON string, and the older guided_decoding object
    for sampling in ({"structured_outputs": json.dumps({"choice": ANSWERS})},
                     {"guided_decoding": {"choice": ANSWERS, "backend": "xgrammar"}}):
        r = grpc_request(server.grpc_url, "pagedserve", text_inputs(
            chat(oracle, "Is the sky blue?"), False, {**sampling, "temperature": 0.9, "seed": 3},
            exclude_input_in_output=True))
        assert text_of(r) in ANSWERS


def test_http_generate_with_request_parameters(server, oracle):
    body = {"text_input": chat(oracle, "Give me a phone number."), "exclude_input_in_output": True,
            "parameters": {"max_tokens": 30, "temperature": 0, "guided_regex": PHONE}}
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate", body)
    assert status == 200, text
    assert re.fullmatch(PHONE, json.loads(text)["text_output"])


def test_invalid_constraints_name_the_field(server, oracle):
    r = grpc_request(server.grpc_url, "pagedserve", text_inputs("hi", False, {"guided_regex": "a(b"}))
    assert r.error is not None and "guided_regex" in str(r.error)
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate",
                             {"text_input": "hi", "parameters": {"guided_json": '{"type": "strin"}'}})
    assert status == 400 and "guided_json" in text
    ok = grpc_request(server.grpc_url, "pagedserve", text_inputs("hi", False, {"max_tokens": 2}))
    assert ok.error is None  # still serving


def test_token_contract_guided_decoding_inputs(server, oracle):
    ids = oracle.tokenizer.encode(chat(oracle, "Give me a phone number."))
    guide = {"guided_decoding_guide_type": (np.array([b"regex"], dtype=np.object_), "BYTES"),
             "guided_decoding_guide": (np.array([PHONE.encode()], dtype=np.object_), "BYTES")}
    r = grpc_request(server.grpc_url, "pagedserve", token_inputs(ids, 30, **guide))
    assert r.error is None, r.error
    out = r.responses[-1][0].as_numpy("output_ids")[0].tolist()[len(ids):]
    assert re.fullmatch(PHONE, oracle.tokenizer.decode(out, skip_special_tokens=True))
    bad = {"guided_decoding_guide_type": (np.array([b"structural_tag"], dtype=np.object_), "BYTES")}
    r = grpc_request(server.grpc_url, "pagedserve", token_inputs(ids, 5, **bad))
    assert r.error is not None and "guided_decoding_guide_type" in str(r.error)


def test_64_concurrent_mixed_requests_on_one_stream(server, oracle):
    """32 unconstrained greedy requests interleaved with 32 constrained ones on one gRPC stream:
    constrained outputs satisfy their constraints, unconstrained ones equal the engine alone."""
    free_prompts = [f"Write one sentence about the number {i}." for i in range(32)]
    kinds = [("json", {"guided_json": PERSON}), ("regex", {"guided_regex": PHONE}),
             ("choice", {"guided_choice": ANSWERS})]
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        for i in range(32):
            client.async_stream_infer("pagedserve", text_inputs(free_prompts[i], False, {
                "max_tokens": 24, "temperature": 0}, exclude_input_in_output=True), request_id=f"free-{i}")
            kind = kinds[i % 3]
            client.async_stream_infer("pagedserve", text_inputs(
                chat(oracle, f"Request {i}: a person as JSON, a phone number, or yes/no?"), False,
                {"max_tokens": 100, "temperature": 0.8, "seed": i, **kind[1]}, exclude_input_in_output=True,
                return_finish_reason=True), request_id=f"{kind[0]}-{i}")
        got = {}
        while len(got) < 64:
            result, error = events.get(timeout=500)
            assert error is None, error
            got[result.get_response().id] = result
    finally:
        client.stop_stream()
        client.close()
    want = oracle.generate(free_prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [got[f"free-{i}"].as_numpy("text_output")[0].decode() for i in range(32)] == [w.text for w in want]
    stopped = 0
    for i in range(32):
        kind = kinds[i % 3][0]
        result = got[f"{kind}-{i}"]
        text, reason = result.as_numpy("text_output")[0].decode(), result.as_numpy("finish_reason")[0].decode()
        if reason == "length":
            assert kind == "json", text
            continue
        stopped += 1
        if kind == "json":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(PHONE, text)
        else:
            assert text in ANSWERS
    assert stopped >= 28
