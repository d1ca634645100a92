"""Request fields against REAL servers (a kserve ModelServer and a tritonserver, both on a tiny
model), queried with the stock clients (openai SDK, httpx, tritonclient.grpc, plain HTTP).

1. `cache_salt` (issue 29.6): per-tenant prefix-cache isolation on every route. Judges: the KServe
   usage's `prompt_tokens_details.cached_tokens` and, on both servers, the engine's prefix-cache
   counters on /metrics: a prompt cached under one salt is a miss under another (the hit counter
   does not move while the lookup counter does), and a hit of every full block under its own.
2. What the docs call unsupported is refused (issue 29.7): every field a docs page names in a
   "not supported" / "not offered" / "unknown here" statement is sent, at a value that uses the
   feature, to the server that page describes, which must refuse it naming the field. And every
   field the code accepts is documented (the lists come from the code, not from this file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from pagedserve.adapters.kserve.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from pagedserve.adapters.triton_server.contracts import ALL_INPUTS, parse_request
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.core.structured_output.params import ALL_KEYS as STRUCTURED_OUTPUT_KEYS

from tests.harness.triton_launch import start_triton_on
from tests.kserve_server import engine_value, scrape as scrape_kserve, start_server as start_kserve, with_chat_template
from tests.tiny_models import VOCAB_SIZE
from tests.triton_helpers import (GrpcStream, grpc_request, http_post, scrape as scrape_triton, text_inputs,
                                  token_inputs, wait_for)

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
BLOCK_SIZE = 16  # the engine default both servers run with
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_chat_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("fields") / "tiny-chat")


@pytest.fixture(scope="module")
def kserve(model_dir, tmp_path_factory):
    srv = start_kserve(model_dir, tmp_path_factory.mktemp("fields-kserve") / "server.log", MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(kserve):
    return openai.OpenAI(base_url=kserve.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def triton(model_dir, tmp_path_factory):
    srv = start_triton_on(tmp_path_factory.mktemp("fields-triton"), {"model": str(model_dir), "dtype": "float32"},
                          timeout=180)
    # the metrics port may open a moment after the models report ready
    assert wait_for(lambda: _answers(srv.metrics_url), timeout=30), "Triton's metrics port never opened"
    yield srv
    srv.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def full_blocks(num_prompt_tokens: int) -> int:
    """Prompt tokens a prefix-cache hit can cover: whole blocks, and never the last token (it must run)."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Counters:
    """The engine's prefix-cache counters on a server's /metrics, read once a request has finished
    (its success count is exported after the cache counters of the same refresh)."""

    def __init__(self, read) -> None:
        self.read = read  # () -> (finished requests, prefix-cache queries, prefix-cache hits)
        self.last = read()

    def after_one_request(self) -> tuple[float, float]:
        """(queries, hits) the request that finished since the last call added."""
        finished = self.last[0] + 1
        now = wait_for(lambda: (s := self.read())[0] >= finished and s, timeout=15)
        assert now and now[0] == finished, f"expected {finished} finished requests on /metrics, got {now}"
        delta = (now[1] - self.last[1], now[2] - self.last[2])
        self.last = now
        return delta


def kserve_counters(kserve) -> Counters:
    def read():
        m = scrape_kserve(kserve.url)
        done = sum(engine_value(m, "pagedserve:request_success_total", MODEL, finished_reason=r)
                   for r in ("stop", "length"))
        return (done, engine_value(m, "pagedserve:prefix_cache_queries_total", MODEL),
                engine_value(m, "pagedserve:prefix_cache_hits_total", MODEL))
    return Counters(read)


def triton_counters(triton) -> Counters:
    def read():
        m = scrape_triton(triton.metrics_url)
        done = sum(v for k, v in m.items() if k.startswith("pagedserve:request_success_total{"))
        return (done, m.get("pagedserve:prefix_cache_queries_total", 0.0),
                m.get("pagedserve:prefix_cache_hits_total", 0.0))
    return Counters(read)


# -- 1. cache_salt ---------------------------------------------------------------------------------------
def t(value, dtype=object):
    return np.array([value], dtype=dtype)


@pytest.mark.parametrize("tensors, parameters, salt", [
    ({"sampling_parameters": t(b'{"cache_salt": "a", "max_tokens": 2}')}, None, "a"),
    ({}, '{"cache_salt": "b", "max_tokens": 2}', "b"),  # no sampling_parameters: request parameters
    ({"sampling_parameters": t(b'{"max_tokens": 2}')}, '{"cache_salt": "c"}', "c"),  # a parameter naming an input
    ({"cache_salt": t(b"d")}, None, "d"),
    ({"sampling_parameters": t(b'{"cache_salt": null}')}, None, None),
    ({}, None, None),
])
def test_triton_text_request_takes_cache_salt_beside_its_sampling_params(tensors, parameters, salt):
    req = parse_request({"text_input": t(b"hi"), **tensors}, parameters)
    assert req.cache_salt == salt and isinstance(req.params, SamplingParams)


@pytest.mark.parametrize("tensors, parameters, message", [
    ({"sampling_parameters": t(b'{"cache_salt": ""}')}, None, "cache_salt is empty"),
    ({"cache_salt": t(b"")}, None, "cache_salt is empty"),
    ({}, '{"cache_salt": 5}', "cache_salt=5: expected a string"),
    ({"cache_salt": t(b"\xff")}, None, "cache_salt is not valid UTF-8"),
    ({"cache_salt": t(b"a"), "sampling_parameters": t(b'{"cache_salt": "b"}')}, None, "cache_salt is given twice"),
])
def test_triton_text_request_bad_cache_salt_is_named(tensors, parameters, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request({"text_input": t(b"hi"), **tensors}, parameters)


def test_triton_token_request_takes_the_cache_salt_input():
    base = {"input_ids": np.array([5, 6], dtype=np.int32), "request_output_len": t(2, np.int32)}
    assert parse_request(base, None).cache_salt is None
    assert parse_request({**base, "cache_salt": t(b"tenant")}, None).cache_salt == "tenant"
    with pytest.raises(InvalidRequest, match="cache_salt is empty"):
        parse_request({**base, "cache_salt": t(b"")}, None)


def test_kserve_request_hands_cache_salt_to_the_engine_not_to_sampling():
    for cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": []})):
        req = cls.model_validate({"model": "m", "cache_salt": "a", **body})
        assert req.engine_kwargs() == {"cache_salt": "a"} and req.sampling_params() == req.model_copy(
            update={"cache_salt": None}).sampling_params()
        assert cls.model_validate({"model": "m", **body}).engine_kwargs() == {"cache_salt": None}
        with pytest.raises(InvalidRequest, match="cache_salt is empty") as exc:
            cls.model_validate({"model": "m", "cache_salt": "", **body}).engine_kwargs()
        assert exc.value.param == "cache_salt"


def test_kserve_cache_salt_isolates_tenants_on_completions_and_chat(client, kserve):
    counters = kserve_counters(kserve)
    ids = rand_ids(100, seed=29)  # 7 blocks; 96 tokens can come from the cache
    messages = [{"role": "user", "content": "Prefix caching shares the blocks of a common prompt. " * 4}]

    def completion(salt: str | None, **kw):
        extra = {"ignore_eos": True} | ({} if salt is None else {"cache_salt": salt})
        return client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0.0, extra_body=extra, **kw)

    def chat(salt: str | None):
        extra = {"ignore_eos": True} | ({} if salt is None else {"cache_salt": salt})
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)

    for send in (completion, chat):
        steps = []
        for salt in ("tenant-a", "tenant-b", "tenant-a", None):
            usage = send(salt).usage
            steps.append((usage.prompt_tokens_details.cached_tokens, *counters.after_one_request()))
        n = usage.prompt_tokens
        assert n > 3 * BLOCK_SIZE, "the prompt must span several KV blocks"
        # first sight; another tenant (looked up, nothing found); the first tenant again (every full
        # block); no salt (unsalted requests share nothing with salted ones)
        assert [(cached, hits) for cached, _queries, hits in steps] == [(0, 0), (0, 0), (full_blocks(n),) * 2, (0, 0)]
        assert all(queries >= n - 1 for _cached, queries, _hits in steps)
    # streaming takes the same path: tenant-b's blocks are cached by now
    chunks = list(completion("tenant-b", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full_blocks(100)
    assert counters.after_one_request()[1] == full_blocks(100)


def test_kserve_v2_infer_takes_cache_salt_as_a_parameter(kserve):
    counters = kserve_counters(kserve)
    url = f"{kserve.url}/v2/models/{MODEL}/infer"
    prompt = "Continuous batching rebuilds the batch every iteration: finished requests leave. " * 3

    def infer(parameters: dict) -> None:
        body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}],
                "parameters": {"max_tokens": 2, **parameters}}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text

    hits = []
    for parameters in ({"cache_salt": "x"}, {"sampling_parameters": json.dumps({"cache_salt": "y"})},
                       {"cache_salt": "y"}):
        infer(parameters)
        hits.append(counters.after_one_request()[1])
    assert hits[:2] == [0, 0] and hits[2] >= 3 * BLOCK_SIZE


@pytest.mark.parametrize("route", ["completions", "chat/completions", "v2"])
def test_kserve_empty_cache_salt_is_a_400_naming_it(kserve, route):
    if route == "v2":
        r = httpx.post(f"{kserve.url}/v2/models/{MODEL}/infer", timeout=30, json={
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
            "parameters": {"cache_salt": ""}})
        assert r.status_code == 400 and "cache_salt is empty" in r.json()["error"]
        return
    body = {"model": MODEL, "max_tokens": 2, "cache_salt": "",
            **({"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]})}
    r = httpx.post(f"{kserve.openai_url}/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt" and "non-empty" in r.json()["error"]["message"]


def test_triton_cache_salt_isolates_tenants_on_both_contracts(triton):
    counters = triton_counters(triton)
    ids = rand_ids(100, seed=2906)
    generate = f"http://{triton.http_url}/v2/models/pagedserve/generate"
    prompt = "The paged KV cache hands out fixed-size blocks on demand. " * 4

    def tokens(salt: str) -> float:
        salt_input = {"cache_salt": (np.array([salt.encode()], dtype=np.object_), "BYTES")}
        res = grpc_request(triton.grpc_url, "pagedserve", token_inputs(ids, 2, **salt_input))
        assert res.error is None, res.error
        return counters.after_one_request()[1]

    # the token contract: the optional input cache_salt
    assert [tokens(s) for s in ("a", "b", "a")] == [0, 0, full_blocks(100)]
    # the text contract: a sampling key (gRPC), the input of that name (a /generate body's key
    # becomes it), a request parameter beside sampling_parameters
    sampling = {"max_tokens": 2, "cache_salt": "a", **GREEDY}
    res = grpc_request(triton.grpc_url, "pagedserve", text_inputs(prompt, False, sampling, return_num_input_tokens=True))
    assert res.error is None, res.error
    n = int(res.responses[-1][0].as_numpy("num_input_tokens")[0])
    assert n > 3 * BLOCK_SIZE and counters.after_one_request()[1] == 0
    status, text = http_post(generate, {"text_input": prompt, "cache_salt": "b", "max_tokens": 2})
    assert status == 200, text
    assert counters.after_one_request()[1] == 0
    stream = GrpcStream(triton.grpc_url)  # over gRPC, request parameters stay parameters
    try:
        stream.send("pagedserve", text_inputs(prompt, False, {"max_tokens": 2}), parameters={"cache_salt": "a"})
        assert stream.collect().error is None
    finally:
        stream.close()
    assert counters.after_one_request()[1] == full_blocks(n)
    status, text = http_post(generate, {"text_input": prompt, "sampling_parameters": json.dumps({"cache_salt": "b"})})
    assert status == 200, text
    assert counters.after_one_request()[1] == full_blocks(n)


def test_triton_bad_cache_salt_is_named(triton):
    generate = f"http://{triton.http_url}/v2/models/pagedserve/generate"
    for body, message in (({"text_input": "hi", "cache_salt": ""}, "cache_salt is empty"),
                          ({"text_input": "hi", "sampling_parameters": '{"cache_salt": 7}'},
                           "cache_salt=7: expected a string"),
                          ({"text_input": "hi", "cache_salt": "a", "sampling_parameters": '{"cache_salt": "b"}'},
                           "cache_salt is given twice")):
        status, text = http_post(generate, body)
        assert status == 400 and message in text, (body, text)
    res = grpc_request(triton.grpc_url, "pagedserve", token_inputs(
        [5, 6, 7], 2, cache_salt=(np.array([b""], dtype=np.object_), "BYTES")))
    assert res.error is not None and "cache_salt is empty" in str(res.error)
    assert grpc_request(triton.grpc_url, "pagedserve", token_inputs([5, 6, 7], 2)).error is None  # still serving


# -- 2. the docs against the code ------------------------------------------------------------------------
CLAIM = re.compile(r"not supported|not offered|unknown here", re.I)
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SERVES = {"triton.md": ("triton",), "kserve.md": ("kserve",), "batch_and_tuning.md": ("kserve",)}
"""Which server a page's claims are about; any other page speaks for both."""

# A value that USES each feature (the no-op values, e.g. `tools: []`, are accepted on purpose): a
# docs page that calls one of these unsupported while the server accepts it fails below. The same
# values serve as Triton sampling keys.
PROBES = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto", "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"7": 5.0}, "best_of": 2, "suffix": " the end", "store": True, "metadata": {"team": "a"},
    "modalities": ["text", "audio"], "guided_whitespace_pattern": r"\s*", "prompt_logprobs": 1,
    "use_beam_search": True, "lora_name": "adapter", "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "[0-9]+", "structured_outputs": {"regex": "[0-9]+"},
    "cache_salt": "tenant", "no_stop_trim": True, "return_hidden_states": True, "continue_final_message": True,
    "include_reasoning": False,
}
FEATURES = {"structured output": "guided_regex", "guided decoding": "guided_regex", "function calling": "tools",
            "beam search": "use_beam_search", "lora": "lora_name", "stored completions": "store"}
"""Features a page may name in words: the field that asks for each."""


def unsupported_claims() -> list[tuple[str, str, str]]:
    """(page, server, field) for every field a docs paragraph, bullet or table row names (in
    backquotes, or as a feature of FEATURES) where it says something is not supported / not
    offered / unknown."""
    out = []
    for page in DOC_PAGES:
        for block in re.split(r"\n\s*\n|\n(?=\s*- |\|)", page.read_text()):
            if CLAIM.search(block):
                fields = re.findall(r"`([a-z][a-z0-9_]*)`", block)
                fields += [field for words, field in FEATURES.items() if words in block.lower()]
                for field in dict.fromkeys(fields):
                    out += [(page.name, server, field) for server in SERVES.get(page.name, ("kserve", "triton"))]
    return out


def test_the_docs_state_unsupported_fields_where_this_test_reads_them():
    # not vacuous: both operator guides list fields they refuse
    assert {page for page, _server, _field in unsupported_claims()} >= {"kserve.md", "triton.md"}


@pytest.mark.parametrize("page, server, field", unsupported_claims())
def test_a_field_the_docs_call_unsupported_is_refused(page, server, field, request):
    assert field in PROBES, f"{page} calls `{field}` unsupported: add a value that uses it to this test's PROBES"
    if server == "kserve":
        srv = request.getfixturevalue("kserve")
        for route, body in (("completions", {"prompt": "hi"}), ("chat/completions",
                                                                {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(f"{srv.openai_url}/{route}", timeout=60,
                           json={"model": MODEL, "max_tokens": 1, **body, field: PROBES[field]})
            assert r.status_code == 400, f"{page} calls `{field}` unsupported, but {route} accepted it: {r.text[:200]}"
            assert r.json()["error"]["param"] == field, r.text
    else:
        srv = request.getfixturevalue("triton")
        status, text = http_post(f"http://{srv.http_url}/v2/models/pagedserve/generate", {
            "text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 1, field: PROBES[field]})})
        assert status == 400, f"{page} calls `{field}` unsupported, but Triton accepted it: {text[:200]}"
        assert field in text, text


def _docs(*names: str) -> str:
    return "\n".join((ROOT / "docs" / name).read_text() for name in names)


def test_every_field_the_code_accepts_is_documented():
    kserve_docs = _docs("kserve.md", "structured_outputs.md")
    fields = {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, *StreamOptions.model_fields}
    assert [f for f in sorted(fields) if f"`{f}`" not in kserve_docs] == []
    triton_docs = _docs("triton.md", "structured_outputs.md")
    assert [i for i in ALL_INPUTS if f"`{i}`" not in triton_docs] == []
    assert [i for i in ALL_INPUTS if f"`{i}`" not in _docs("contracts.md", "structured_outputs.md")] == []
    # structured_output and bad_words_token_ids are filled by the code, never sent
    keys = {*SamplingParams.__dataclass_fields__, *STRUCTURED_OUTPUT_KEYS, "best_of"} - {"structured_output",
                                                                                      "bad_words_token_ids"}
    assert [k for k in sorted(keys) if f"`{k}`" not in triton_docs] == []
