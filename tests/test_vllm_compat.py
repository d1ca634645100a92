"""What vLLM clients, routers and autoscalers expect, against REAL servers on a tiny model (a kserve
ModelServer with an API key, a tritonserver), with the stock clients (openai SDK, httpx,
tritonclient.grpc, plain HTTP). Oracles: transformers' forward and logits processors on the same
model (tests/oracle.py), and the servers' own names and shapes as vLLM defines them.

1. Request fields: `logit_bias`, `bad_words`, `min_tokens`, `prompt_logprobs` on completions and
   chat; `prompt_logprobs` over Triton's text contract.
2. Routes: /v1/completions, /v1/chat/completions, /v1/models (OpenAI's list and KServe's v1 list in
   one body), /health, /metrics, under the same API key as /openai/v1.
3. Metrics under vLLM's names on both servers (`vllm:*`, `vllm:cache_config_info`).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from pagedserve.adapters.engine_metrics import VLLM_LABELLED_COUNTERS, VLLM_METRICS

from tests.harness.triton_launch import start_triton_on
from tests.kserve_server import start_server as start_kserve, with_chat_template
from tests.oracle import hf_processed_greedy, hf_prompt_logprobs
from tests.triton_helpers import GrpcStream, grpc_request, http_post, text_inputs, wait_for

pytestmark = pytest.mark.timeout(900)  # server start included: minutes on a loaded shared machine

MODEL = "tiny"
KEY = "sekret-key"
EOS = 0
PROMPT = [17, 203, 45, 99, 310, 7, 64, 150, 88, 23, 5, 271]
TEXT = "The paged KV cache hands out"
TOP = 2


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_chat_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("compat") / "tiny-chat")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def kserve(model_dir, tmp_path_factory):
    srv = start_kserve(model_dir, tmp_path_factory.mktemp("compat-kserve") / "server.log", MODEL,
                       env={"PAGEDSERVE_API_KEY": KEY}, timeout=600)  # a loaded shared machine: generous
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def v1(kserve):
    """The openai SDK at vLLM's base URL, /v1."""
    return openai.OpenAI(base_url=f"{kserve.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def triton(model_dir, tmp_path_factory):
    srv = start_triton_on(tmp_path_factory.mktemp("compat-triton"), {"model": str(model_dir), "dtype": "float32"},
                          timeout=600)  # a loaded shared machine: generous
    yield srv
    srv.stop()


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text)


def assert_prompt_logprobs(got: list, prompt: list[int], expected: list) -> None:
    """vLLM's shape against transformers: per position null (the first) or {id: {logprob, rank,
    decoded_token}}, the prompt token and the top-N."""
    assert len(got) == len(prompt) and got[0] is None
    for j, (pos, exp) in enumerate(zip(got[1:], expected[1:]), start=1):
        logprob, top_ids = exp
        entry = pos[str(prompt[j])]
        assert entry["logprob"] == pytest.approx(logprob, abs=1e-3), f"position {j}"
        assert {str(t) for t in top_ids} <= set(pos) and len(pos) <= TOP + 1, f"position {j}: {pos}"
        ranks = sorted(pos[str(t)]["rank"] for t in top_ids)
        assert ranks == list(range(1, TOP + 1)), f"position {j}"


# -- 1. request fields ---------------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens_on_completions_and_chat(v1, model_dir, tokenizer):
    favourite = 300
    out = v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                logit_bias={str(favourite): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == tokenizer.decode([favourite] * 5)
    plain = hf_processed_greedy(model_dir, PROMPT, 5)
    banned = {plain[0]: -100.0}
    out = v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                logit_bias={str(t): b for t, b in banned.items()}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == tokenizer.decode(hf_processed_greedy(model_dir, PROMPT, 5, bias=banned))
    assert out.choices[0].text != tokenizer.decode(plain)
    messages = [{"role": "user", "content": "hi"}]
    chat = v1.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                      logit_bias={str(favourite): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tokenizer.decode([favourite] * 4)
    with pytest.raises(openai.BadRequestError, match="logit_bias") as exc:
        v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={"5": 101})
    assert exc.value.body["param"] == "logit_bias"


def bad_word(tokenizer, tokens: list[int]) -> tuple[str, list[list[int]]]:
    """A two-token word in greedy output whose spelling the server bans is the one written (the
    engine bans each word as sent and after a space), and those two spellings."""
    for i in range(len(tokens) - 1):
        word = tokenizer.decode(tokens[i:i + 2]).strip()
        spellings = [tokenizer.encode(s + word, add_special_tokens=False) for s in ("", " ")]
        if word and tokens[i:i + 2] in spellings:
            return word, spellings
    raise AssertionError(f"no two-token word in {tokens}")


def test_bad_words_never_appear_on_completions_and_chat(v1, model_dir, tokenizer):
    for chat in (False, True):
        messages = [{"role": "user", "content": TEXT}]
        prompt = chat_prompt_ids(tokenizer, messages) if chat else tokenizer.encode(TEXT)
        plain = hf_processed_greedy(model_dir, prompt, 16)
        word, spellings = bad_word(tokenizer, plain)
        extra = {"bad_words": [word], "ignore_eos": True}
        if chat:
            out = v1.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                             extra_body=extra).choices[0].message.content
        else:
            out = v1.completions.create(model=MODEL, prompt=TEXT, max_tokens=16, temperature=0,
                                        extra_body=extra).choices[0].text
        assert word in tokenizer.decode(plain) and word not in out, (word, out)
        assert out == tokenizer.decode(hf_processed_greedy(model_dir, prompt, 16, bad_words=spellings))


def test_min_tokens_holds_back_eos_on_completions_and_chat(v1):
    push_eos = {str(EOS): 100}  # EOS is the greedy choice at every step
    for min_tokens, expected in ((0, 1), (3, 4)):
        out = v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=push_eos,
                                    extra_body={"min_tokens": min_tokens})
        assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (expected, "stop")
        chat = v1.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                          temperature=0, logit_bias=push_eos, extra_body={"min_tokens": min_tokens})
        assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (expected, "stop")


def test_prompt_logprobs_on_completions_and_chat_match_transformers(v1, model_dir, tokenizer):
    expected = hf_prompt_logprobs(model_dir, PROMPT, TOP)
    out = v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                extra_body={"prompt_logprobs": TOP})
    for choice in out.choices:  # every choice of the prompt carries them, as vLLM
        assert_prompt_logprobs(choice.model_extra["prompt_logprobs"], PROMPT, expected)
    stream = list(v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
                                        extra_body={"prompt_logprobs": TOP}))
    with_them = [c for c in stream if c.choices and c.choices[0].model_extra.get("prompt_logprobs")]
    assert len(with_them) == 1 and with_them[0] is stream[0]
    assert_prompt_logprobs(stream[0].choices[0].model_extra["prompt_logprobs"], PROMPT, expected)
    messages = [{"role": "user", "content": TEXT}]
    ids = chat_prompt_ids(tokenizer, messages)
    chat = v1.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                      extra_body={"prompt_logprobs": TOP})
    assert_prompt_logprobs(chat.model_extra["prompt_logprobs"], ids, hf_prompt_logprobs(model_dir, ids, TOP))
    # without the field the body has none (nothing is computed)
    assert "prompt_logprobs" not in v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices[0].model_extra


def test_prompt_logprobs_over_tritons_text_contract_match_transformers(triton, model_dir, tokenizer):
    ids = tokenizer.encode(TEXT)
    expected = hf_prompt_logprobs(model_dir, ids, TOP)
    sampling = {"max_tokens": 3, "temperature": 0, "prompt_logprobs": TOP}
    res = grpc_request(triton.grpc_url, "pagedserve", text_inputs(TEXT, False, sampling))
    assert res.error is None, res.error
    (result, _final), = [r for r in res.responses if r[0].as_numpy("text_output") is not None]
    assert_prompt_logprobs(json.loads(result.as_numpy("prompt_logprobs")[0]), ids, expected)
    # streaming: once, in the first response
    stream = GrpcStream(triton.grpc_url)
    try:
        stream.send("pagedserve", text_inputs(TEXT, True, sampling))
        got = stream.collect()
    finally:
        stream.close()
    assert got.error is None, got.error
    carrying = [r for r, _ in got.responses if r.as_numpy("prompt_logprobs") is not None]
    assert len(carrying) == 1 and carrying[0] is got.responses[0][0]
    assert_prompt_logprobs(json.loads(carrying[0].as_numpy("prompt_logprobs")[0]), ids, expected)
    # /generate (JSON): the output is a JSON string field; logit_bias and bad_words ride along
    status, body = http_post(f"http://{triton.http_url}/v2/models/pagedserve/generate", {
        "text_input": TEXT, "sampling_parameters": json.dumps({**sampling, "logit_bias": {"300": 100}})})
    assert status == 200, body
    reply = json.loads(body)
    assert_prompt_logprobs(json.loads(reply["prompt_logprobs"]), ids, expected)
    assert reply["text_output"] == TEXT + tokenizer.decode([300] * 3)


# -- 2. routes -----------------------------------------------------------------------------------------------
def test_v1_routes_serve_the_openai_sdk_with_the_same_key(v1, kserve):
    assert [m.id for m in v1.models.list()] == [MODEL]
    out = v1.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    same = openai.OpenAI(base_url=kserve.openai_url, api_key=KEY, max_retries=0).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == same.choices[0].text and out.object == "text_completion"
    chat = v1.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.object == "chat.completion" and chat.usage.completion_tokens == 2
    anonymous = openai.OpenAI(base_url=f"{kserve.url}/v1", api_key="wrong", max_retries=0)
    for call in (anonymous.models.list, lambda: anonymous.completions.create(model=MODEL, prompt="hi", max_tokens=1),
                 lambda: anonymous.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(openai.AuthenticationError):
            call()


def test_v1_models_answers_kserve_and_openai_clients_in_one_body(kserve):
    r = httpx.get(f"{kserve.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["models"] == [MODEL]  # KServe's v1 protocol
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]  # OpenAI's
    assert httpx.get(f"{kserve.url}/v1/models", timeout=10).status_code == 401
    # KServe's v1 prediction route is still kserve's own, and open as before
    r = httpx.post(f"{kserve.url}/v1/models/{MODEL}:predict", timeout=60,
                   json={"instances": ["hi"], "parameters": {"max_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1


def test_v1_model_route_answers_kserve_readiness_and_openai_retrieve(v1, kserve):
    """`GET /v1/models/{id}` is KServe's v1 readiness check and the SDK's models.retrieve at /v1."""
    probe = httpx.get(f"{kserve.url}/v1/models/{MODEL}", timeout=10)  # as KServe's probe: no key
    assert probe.status_code == 200
    body = probe.json()
    assert body["name"] == MODEL and body["ready"] is True  # KServe's v1 protocol
    card = v1.models.retrieve(MODEL)  # OpenAI's
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "pagedserve")
    assert card.created == body["created"] and card.created > 1_600_000_000
    assert card.model_dump(exclude={"name", "ready"}) == v1.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        v1.models.retrieve("no-such-model")
    assert httpx.get(f"{kserve.url}/v1/models/no-such-model", timeout=10).status_code == 404


def test_tokenize_and_detokenize_answer_as_vllms_do(v1, kserve, model_dir, tokenizer):
    """vLLM's /tokenize (what vllm-router's cache-aware policy asks each worker for) gives the ids the
    engine runs: the oracle is transformers' tokenizer and the prompt_tokens of the same request."""
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path, body):
        return httpx.post(f"{kserve.url}{path}", json=body, headers=auth, timeout=60)

    r = post("/tokenize", {"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    assert body == {"count": len(body["tokens"]), "max_model_len": max_len, "tokens": tokenizer(TEXT).input_ids,
                    "token_strs": None}
    assert body["count"] == v1.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage.prompt_tokens
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}]
    chat = post("/tokenize", {"model": MODEL, "messages": messages, "continue_final_message": False}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(rendered).input_ids
    assert chat["count"] == v1.chat.completions.create(model=MODEL, messages=messages,
                                                       max_tokens=1).usage.prompt_tokens
    assert post("/detokenize", {"model": MODEL, "tokens": body["tokens"]}).json() == {
        "prompt": tokenizer.decode(body["tokens"])}
    # errors name what was wrong; the key guards both routes
    assert httpx.post(f"{kserve.url}/tokenize", json={"prompt": TEXT}, timeout=10).status_code == 401
    assert post("/tokenize", {"model": "other", "prompt": TEXT}).status_code == 404
    r = post("/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
    r = post("/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400 and "1000000000" in r.json()["error"]["message"]
    r = post("/tokenize", {"prompt": TEXT, "unknown": 1})
    assert r.status_code == 400 and "unknown" in r.json()["error"]["message"]


def test_health_and_metrics_answer_without_a_key(kserve):
    r = httpx.get(f"{kserve.url}/health", timeout=10)
    assert r.status_code == 200
    assert httpx.get(f"{kserve.url}/metrics", timeout=10).status_code == 200


# -- 3. metrics under vLLM's names ---------------------------------------------------------------------------
def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def vllm_families_present(found: dict, labels: dict[str, str]) -> list[str]:
    """The vLLM names that are missing from a scrape, for the given labels."""
    want = []
    for m in VLLM_METRICS:
        kind = m.kind.value
        want.append(m.name + ("_count" if kind == "histogram" else ""))
    missing = [n for n in want if (n, tuple(sorted(labels.items()))) not in found]
    for c in VLLM_LABELLED_COUNTERS:
        if not any(name == c.name and dict(lab).get(c.label) for name, lab in found):
            missing.append(c.name)
    return missing


def test_kserve_metrics_carry_vllms_names_beside_pagedserves(v1, kserve):
    long_prompt = list(range(40, 80))  # two full blocks: the second request hits the prefix cache
    for _ in range(2):
        v1.completions.create(model=MODEL, prompt=long_prompt, max_tokens=3, temperature=0)
    found = samples(httpx.get(f"{kserve.url}/metrics", timeout=10).text)
    vllm = {"model_name": MODEL}
    own = {"model": MODEL, "version": "1"}
    assert vllm_families_present(found, vllm) == []
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "generation_tokens_total", "e2e_request_latency_seconds_count",
                 "time_to_first_token_seconds_count"):
        assert found[(f"vllm:{name}", tuple(vllm.items()))] == found[(f"pagedserve:{name}", tuple(sorted(own.items())))]
    assert found[("vllm:prefix_cache_hits_total", tuple(vllm.items()))] > 0
    info = [dict(lab) for name, lab in found if name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0]["block_size"] == "16" and int(info[0]["num_gpu_blocks"]) > 0
    assert info[0]["model_name"] == MODEL and found[("vllm:cache_config_info", tuple(sorted(info[0].items())))] == 1


def test_triton_metrics_carry_vllms_names_beside_pagedserves(triton):
    res = grpc_request(triton.grpc_url, "pagedserve", text_inputs(TEXT, False, {"max_tokens": 2, "ignore_eos": True}))
    assert res.error is None, res.error
    labels = {"model": "pagedserve", "version": "1"}

    def scrape():
        found = samples(httpx.get(triton.metrics_url, timeout=10).text)
        return found if found.get(("vllm:request_success_total", tuple(sorted(
            {**labels, "finished_reason": "length"}.items()))), 0) >= 1 else None

    found = wait_for(scrape, timeout=15)
    assert found, "the finished request never reached Triton's metrics"
    assert vllm_families_present(found, labels) == []
    key = tuple(sorted(labels.items()))
    for name in ("generation_tokens_total", "prompt_tokens_total", "e2e_request_latency_seconds_count"):
        assert found[(f"vllm:{name}", key)] == found[(f"pagedserve:{name}", key)] > 0
    info = [dict(lab) for name, lab in found if name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0]["block_size"] == "16" and int(info[0]["num_gpu_blocks"]) > 0
