"""The corners of the OpenAI surface that third-party clients (lm-eval, aiperf, genai-perf) hit on
the KServe routes (issue 19): prompt scoring with echo and max_tokens=0, explicit nulls, models
retrieve, error params, no-op values of unsupported features, streamed usage and cached tokens.

The stock `openai` client (raw httpx where the wire format itself is the point) against a real
kserve ModelServer; transformers is the oracle for prompt logprobs; for "null / a no-op value
changes nothing" the oracle is the same request without the field, on the same server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.kserve_server import start_server, with_chat_template
from tests.oracle import hf_model

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
PROMPT = "Prefix caching shares the blocks of a common prompt"
MESSAGES = [{"role": "user", "content": "What is a paged KV cache?"}]
BLOCK_SIZE = 16  # the engine default the server runs with


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_chat_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("kserve-surface") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_server(model_dir, tmp_path_factory.mktemp("kserve-surface-log") / "server.log", MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers: row i is log_softmax of the logits after ids[:i + 1], i.e. the distribution of ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(model_dir)(torch.tensor([ids])).logits[0].float(), dim=-1)


def sse_events(server, route: str, body: dict) -> list[dict]:
    """A stream's events as the server wrote them (the SDK's models hide whether a key was sent)."""
    events = []
    with httpx.stream("POST", f"{server.openai_url}/{route}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# -- 1. echo without generation: prompt scoring ----------------------------------------------------------
@pytest.mark.parametrize("top", [0, 3])
def test_echo_with_max_tokens_0_returns_the_prompt_scored_by_transformers(client, model_dir, tokenizer, top):
    ids = tokenizer.encode(PROMPT)
    ref = prompt_logprobs(model_dir, ids)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=top)
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.token_logprobs[1:] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for i in range(1, len(ids)):
        want = {tokenizer.decode([t]) for t in ref[i - 1].topk(top).indices.tolist()} | {lp.tokens[i]}
        assert set(lp.top_logprobs[i]) == want, i


def test_echo_scoring_of_token_id_prompts_batched_and_streamed(client, model_dir, tokenizer):
    """lm-eval's loglikelihood sends token ids, several prompts per request."""
    a, b = tokenizer.encode(PROMPT), tokenizer.encode("Continuous batching rebuilds the batch")
    out = client.completions.create(model=MODEL, prompt=[a, b], max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in out.choices] == [tokenizer.decode(a), tokenizer.decode(b)]
    for ids, choice in zip((a, b), out.choices):
        ref = prompt_logprobs(model_dir, ids)
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(a) + len(b), 0)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0


def test_echo_alone_and_max_tokens_0_without_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert out.choices[0].text == PROMPT and out.choices[0].logprobs is None and out.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert err.value.param == "max_tokens" and "echo=true" in err.value.message


# -- 2. explicit null on nullable fields -----------------------------------------------------------------
def test_explicit_null_means_the_default(client):
    base = dict(model=MODEL, max_tokens=8, temperature=0.0)
    nulls = dict(n=None, top_p=None, stop=None, seed=None, presence_penalty=None, frequency_penalty=None,
                 user=None, stream_options=None)
    chat = client.chat.completions.create(messages=MESSAGES, **base, extra_body={"ignore_eos": True})
    chat_nulls = client.chat.completions.create(
        messages=MESSAGES, **base, **nulls, logprobs=None, top_logprobs=None, max_completion_tokens=None,
        extra_body={"ignore_eos": True, "add_generation_prompt": None, "tools": None, "tool_choice": None,
                    "response_format": None, "store": None, "metadata": None, "parallel_tool_calls": None})
    assert chat_nulls.choices[0].message.content == chat.choices[0].message.content
    assert chat_nulls.choices[0].logprobs is None and chat_nulls.usage.completion_tokens == 8

    cmpl = client.completions.create(prompt=PROMPT, **base, extra_body={"ignore_eos": True})
    cmpl_nulls = client.completions.create(prompt=PROMPT, **base, **nulls, echo=None, logprobs=None, best_of=None,
                                           suffix=None, logit_bias=None, extra_body={"ignore_eos": True})
    assert cmpl_nulls.choices[0].text == cmpl.choices[0].text and cmpl_nulls.choices[0].logprobs is None


# -- 3. models.retrieve ----------------------------------------------------------------------------------
def test_models_retrieve(client, server):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    for unknown in ("gpt-4", "org/name"):  # ids with a slash travel in the path as they are
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(unknown)
        assert (err.value.code, err.value.param) == ("model_not_found", "model") and unknown in err.value.message
    r = httpx.get(f"{server.openai_url}/models/org/name", timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- 4. range errors name the parameter the client sent ----------------------------------------------------
@pytest.mark.parametrize("route,fields,param,needle", [
    ("completions", {"max_tokens": -1}, "max_tokens", "max_tokens=-1 is out of range"),
    ("completions", {"top_p": 0.0}, "top_p", "top_p=0.0 is out of range"),
    ("completions", {"n": 1000}, "n", "n=1000 is out of range"),
    ("completions", {"logprobs": 25}, "logprobs", "logprobs=25 is out of range"),
    ("completions", {"temperature": 101}, "temperature", "temperature=101.0 is out of range"),
    ("completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens=9 exceeds max_tokens=4"),
    ("completions", {"stop": [str(i) for i in range(17)]}, "stop", "stop has 17 strings"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 25}, "top_logprobs", "top_logprobs=25 is out of range"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens=0 is out"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens", "max_tokens=0 is out of range"),
])
def test_range_errors_name_the_parameter(client, route, fields, param, needle):
    create = client.completions.create if route == "completions" else client.chat.completions.create
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    with pytest.raises(openai.BadRequestError) as err:
        create(model=MODEL, **prompt, extra_body=fields)
    assert err.value.param == param and needle in err.value.message, err.value.body


# -- 5. no-op values accepted, values asking for missing features refused -----------------------------------
def test_noop_values_change_nothing(client):
    base = dict(model=MODEL, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=MESSAGES, **base)
    noop = client.chat.completions.create(messages=MESSAGES, **base, response_format={"type": "text"}, tools=[],
                                          tool_choice="none", parallel_tool_calls=False, store=False, metadata=None)
    assert noop.choices[0].message.content == plain.choices[0].message.content
    both = client.chat.completions.create(messages=MESSAGES, **base, parallel_tool_calls=True, metadata={})
    assert both.choices[0].message.content == plain.choices[0].message.content

    plain = client.completions.create(prompt=PROMPT, **base)
    noop = client.completions.create(prompt=PROMPT, **base, best_of=1, logit_bias={}, suffix="")
    assert noop.choices[0].text == plain.choices[0].text
    sampled = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=5, n=2)
    assert ([c.text for c in client.completions.create(**sampled, best_of=2).choices]
            == [c.text for c in client.completions.create(**sampled).choices])


@pytest.mark.parametrize("route,fields,param", [
    ("chat/completions", {"response_format": {"type": "grammar"}}, "response_format"),
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat/completions", {"store": True}, "store"),
    ("chat/completions", {"metadata": {"team": "a"}}, "metadata"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
    ("completions", {"suffix": "end"}, "suffix"),
])
def test_values_asking_for_missing_features_are_refused(server, client, route, fields, param):
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    r = httpx.post(f"{server.openai_url}/{route}", json={"model": MODEL, **prompt, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    assert "omit" in err["message"], "the message says how to fix the request"


# -- 6. streamed usage and cached tokens ------------------------------------------------------------------
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_include_usage_sends_null_usage_until_the_usage_chunk(server, route):
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    body = {"model": MODEL, **prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    events = sse_events(server, route, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" in e and e["usage"] is None for e in events[:-1]) and len(events) == 6
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" not in e for e in sse_events(server, route, body))  # not asked: not sent


def test_continuous_usage_stats_puts_the_running_usage_on_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    content, final = chunks[:-1], chunks[-1]
    assert [c.usage.completion_tokens for c in content] == [1, 2, 3, 4, 5, 6]  # one token per step
    assert {c.usage.prompt_tokens for c in content} == {final.usage.prompt_tokens}
    assert final.choices == [] and final.usage.completion_tokens == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    # vLLM's rule: without include_usage, continuous_usage_stats alone adds nothing
    alone = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                                stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone) and all(c.choices for c in alone)


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(client):
    ids = torch.randint(0, 384, (40,), generator=torch.Generator().manual_seed(19)).tolist()
    kw = dict(model=MODEL, prompt=ids, max_tokens=2)
    first = client.completions.create(**kw).usage
    assert (first.prompt_tokens, first.prompt_tokens_details.cached_tokens) == (40, 0)
    want = (40 - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks; the last prompt token always runs
    assert client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == want
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == want
    # a prompt diverging inside its second block shares one block; chat reports it the same way
    assert client.completions.create(**{**kw, "prompt": ids[:20] + [1] * 10}).usage.prompt_tokens_details \
        .cached_tokens == BLOCK_SIZE
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
