"""The KServe adapter's OpenAI routes, end to end: the stock `openai` client against a real kserve
ModelServer (a subprocess), checked against the core engine run in-process on the same model with
the same parameters (LLMEngine.generate is the oracle for every greedy or seeded output).

The server loads tests/server_hooks for the batching test: a batch log (how many samples each
forward pass gave a token: what the engine batched, told without a clock) and a pace file (slower
steps while the test holds it, so requests sent together reach the engine together on a busy machine)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.kserve_server import engine_value, scrape, start_server, with_chat_template
from tests.reliability_helpers import batch_sizes, kserve_hooks_env, paced

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
PROMPT = "The paged KV cache hands out fixed-size blocks"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is batching?"}]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_chat_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("kserve-openai") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kserve-openai-log")
    hooks = kserve_hooks_env(batch_log=tmp / "batches.log", pace_file=tmp / "pace")
    srv = start_server(model_dir, tmp / "server.log", MODEL, env=hooks)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle(model_dir):
    """The core engine in-process: same model, same dtype, same defaults as the server."""
    return LLMEngine(EngineConfig.from_dict({"model": str(model_dir), "dtype": "float32"}))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)


def expect(oracle, prompt, **params):
    return oracle.generate([prompt], SamplingParams(**params))


def wait_until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_models_route_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_streamed_and_not_equal_the_engine(client, oracle):
    (want,) = expect(oracle, PROMPT, max_tokens=20, **GREEDY)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.choices[0].text == want.text
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(want.prompt_token_ids), 20)
    assert full.usage.total_tokens == len(want.prompt_token_ids) + 20

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_streamed_and_not_equal_the_engine(client, oracle):
    prompt = oracle.apply_chat_template(MESSAGES)
    (want,) = expect(oracle, prompt, max_tokens=16, **GREEDY)
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw, max_completion_tokens=16)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == want.text
    assert full.usage.prompt_tokens == len(want.prompt_token_ids) and full.usage.completion_tokens == 16

    chunks = list(client.chat.completions.create(**kw, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want.text
    assert chunks[-1].usage.completion_tokens == 16


def test_stop_string_ends_the_text_before_it(client, oracle):
    (free,) = expect(oracle, PROMPT, max_tokens=24, **GREEDY)
    # A stop string taken from the middle of the free-running output (ASCII, so it cannot sit in
    # a half-decoded character); OpenAI: the returned text stops before it and excludes it.
    start = next(i for i in range(4, len(free.text) - 2) if free.text[i:i + 2].isascii() and free.text[i:i + 2].strip())
    stop = free.text[start:start + 2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]
    (engine_out,) = expect(oracle, PROMPT, max_tokens=24, stop=(stop,), **GREEDY)
    assert out.text == engine_out.text


def test_n_samples_and_seed(client, oracle):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, n=3, seed=11)
    first = client.completions.create(**kw)
    want = expect(oracle, PROMPT, max_tokens=10, temperature=0.9, n=3, seed=11)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [w.text for w in want]
    assert len({c.text for c in first.choices}) > 1, "the samples of one request must differ"
    assert first.usage.completion_tokens == 30
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]  # seed: reproducible
    other = client.completions.create(**{**kw, "seed": 12})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_completion_logprobs_and_echo(client, oracle):
    (want,) = expect(oracle, PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0]
    lp = out.logprobs
    assert "".join(lp.tokens) == out.text == want.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-3)
    decode = oracle.tokenizer.decode
    for chosen, top, entry in zip(lp.token_logprobs, lp.top_logprobs, want.logprobs):
        # the top 3 and the chosen token, keyed by text (OpenAI's format: tokens that decode to the
        # same text, like partial UTF-8 bytes, share one key)
        assert set(top) == {decode([t]) for t, _ in entry.top} | {decode([entry.token_id])}
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy picks the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text == PROMPT + want.text


def test_chat_logprobs(client, oracle):
    prompt = oracle.apply_chat_template(MESSAGES)
    (want,) = expect(oracle, prompt, max_tokens=5, logprobs=2, **GREEDY)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0.0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-3)
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
    no_lp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0.0)
    assert no_lp.choices[0].logprobs is None


def test_sixteen_concurrent_streaming_chats_are_batched(server, oracle):
    convs = [[{"role": "user", "content": f"Request {i}: count to {i}."}] for i in range(16)]
    want = oracle.generate([oracle.apply_chat_template(m) for m in convs],
                           SamplingParams(max_tokens=48, **GREEDY))
    batch_log = server.log_path.parent / "batches.log"
    logged = len(batch_sizes(batch_log))

    async def one(client, messages):
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                                      temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def main():
        client = openai.AsyncOpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, m) for m in convs))

    # 10 ms a step: each stream's 48 steps take at least half a second, in which the adapter, however
    # starved, hands the engine every request sent together (a tiny model's unpaced decode step
    # takes under a ms).
    with paced(server.log_path.parent / "pace", 0.01):
        results = asyncio.run(main())
    assert [r[0] for r in results] == [w.text for w in want]
    assert all(r[1] == "length" for r in results)
    # The engine batched them: forward passes gave several of them a token at once. (Sampling the
    # num_requests_running gauge, refreshed periodically, for this missed the batch.)
    sizes = batch_sizes(batch_log, since=logged)
    assert sum(sizes) == 16 * 48 and max(sizes) > 1, sizes


def _engine_idle_with_aborts(server, aborts: float) -> bool:
    m = scrape(server.url)
    return (engine_value(m, "pagedserve:num_requests_running", MODEL) == 0
            and engine_value(m, "pagedserve:kv_cache_usage_perc", MODEL) == 0
            and engine_value(m, "pagedserve:request_success_total", MODEL, finished_reason="abort") == aborts)


def _aborts(server) -> float:
    return engine_value(scrape(server.url), "pagedserve:request_success_total", MODEL, finished_reason="abort")


def test_stream_events_survive_a_client_that_splits_lines_like_str_splitlines(server, client):
    """U+0085, U+2028 and U+2029 in the text (here echoed from the prompt) stay escaped in the
    events: httpx's iter_lines, like str.splitlines, ends a line at each, and a raw one cut an event
    in two (the soak's client failed on a random model's output: issue 29)."""
    prompt = "line\u2028sep\x85next\u2029para"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
            "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.openai_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines), lines
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert text == whole and text.startswith(prompt)


def test_dropped_stream_aborts_its_engine_request(server):
    aborts = _aborts(server)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.openai_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(json.loads(line[6:]))
            if len(got) == 3:
                break  # leaving the block closes the connection midway
    assert all(c["choices"][0]["finish_reason"] is None for c in got)
    wait_until(lambda: _engine_idle_with_aborts(server, aborts + 1), what="the dropped stream's abort")


def test_dropped_non_streaming_request_aborts_its_engine_request(server):
    aborts = _aborts(server)
    body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 1000, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    try:
        sock.sendall(b"POST /openai/v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: engine_value(scrape(server.url), "pagedserve:num_requests_running", MODEL) == 1,
                   what="the request to run")
    finally:
        sock.close()
    wait_until(lambda: _engine_idle_with_aborts(server, aborts + 1), what="the dropped request's abort")


TOO_LONG = "a b " * 700  # > 1024 tokens: the tiny model's max_model_len


@pytest.mark.parametrize("route,body,status,needle", [
    ("completions", b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens=-1"),
    ("completions", {"model": MODEL, "prompt": TOO_LONG}, 400, "max_model_len"),
    ("completions", {"model": MODEL, "prompt": TOO_LONG, "stream": True}, 400, "max_model_len"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "content"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, 400, "logprobs"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}, 400,
     "max_completion_tokens=0"),
])
def test_bad_input_is_an_openai_error_and_the_server_keeps_serving(server, client, route, body, status, needle):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.openai_url}/{route}", content=content, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_stock_client_raises_the_documented_error_classes(client):
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-3)
    assert "max_tokens=-3" in bad.value.message
