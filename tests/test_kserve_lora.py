"""Multi-LoRA on the KServe server (issue 34), end to end: a real `pagedserve kserve --enable-lora
--lora-modules ...` in a subprocess, the stock `openai` SDK picking adapters by `model`, httpx for
vLLM's load/unload routes and the v2 route, /metrics for vllm:lora_requests_info.

Oracle: the core engine in-process on the same model and adapters (LLMEngine.generate with the same
lora_name); whether the engine's adapter math equals PEFT's is tests/ of the engine (issue 34's
engine half). Each adapter is random with non-zero B, saved by PEFT itself (tests/lora_oracle.py), and
the test first checks that the adapters'
tokens differ from the base model's and from each other's, so a server that ran the wrong adapter
(or none) cannot pass."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.harness import ONE_THREAD
from tests.harness.kserve_launch import start_kserve
from tests.kserve_server import with_chat_template
from tests.lora_oracle import make_adapter
from tests.reliability_helpers import kserve_hooks_env

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
KEY = "lora-test-key"
PROMPT = "The paged KV cache hands out fixed-size blocks"
MESSAGES = [{"role": "user", "content": "What is batching?"}]
GREEDY = dict(temperature=0.0, ignore_eos=True)
STD = 0.1
"""Of the adapters' random A and B: large enough that each changes the tiny model's greedy tokens."""
STEP_DELAY_S = 0.01
"""Each engine step takes at least this long in the server (test hook), so a long stream is still
running while the test does something else."""


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_chat_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("kserve-lora") / "tiny-chat")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """name -> PEFT directory: two served from the start, one loaded at run time, one the engine
    must refuse (rank 16 over --max-lora-rank 8)."""
    root = tmp_path_factory.mktemp("kserve-lora-adapters")
    return {"sql": make_adapter(model_dir, root / "sql", seed=1, std=STD),
            "chat": make_adapter(model_dir, root / "chat", seed=2, std=STD, targets=("q_proj", "v_proj")),
            "late": make_adapter(model_dir, root / "late", seed=3, std=STD),
            "too-wide": make_adapter(model_dir, root / "too-wide", seed=4, std=STD, r=16)}


@pytest.fixture(scope="module")
def server(model_dir, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("kserve-lora-log") / "server.log"
    srv = start_kserve(model_dir, log, MODEL, env={**ONE_THREAD, **kserve_hooks_env(delay=STEP_DELAY_S)},
                       args=("--dtype", "float32", "--api-key", KEY, "--enable-lora", "--max-loras", "2",
                             "--max-lora-rank", "8", "--lora-modules", f"sql={adapters['sql']}",
                             f"chat={adapters['chat']}", "--allow-runtime-lora-updating"),
                       timeout=180)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle(model_dir, adapters):
    """The core engine in-process: same model, dtype and adapters as the server."""
    return LLMEngine(EngineConfig.from_dict({
        "model": str(model_dir), "dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
        "lora_modules": {name: str(adapters[name]) for name in ("sql", "chat", "late")}}))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key=KEY, max_retries=0, timeout=120)


def expect(oracle, prompt, lora_name: str | None, **params):
    (result,) = oracle.generate([prompt], SamplingParams(**params), lora_name=lora_name)
    return result


def post(server, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{route}", json=body, headers=headers, timeout=60)


def completion(client, model: str, max_tokens: int = 16) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model  # vLLM names the adapter that ran
    return out.choices[0].text


def test_the_adapters_change_the_tokens(oracle):
    """The oracle itself: otherwise "equal to the engine" would not tell adapters apart."""
    texts = {name: expect(oracle, PROMPT, name, max_tokens=16, **GREEDY).text for name in (None, "sql", "chat")}
    assert len(set(texts.values())) == 3, texts


def test_models_lists_the_base_and_each_adapter_with_parent_and_root(client, server, adapters):
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL, "sql", "chat"]
    for card in cards[1:]:
        assert card.parent == MODEL and card.root == str(adapters[card.id])  # vLLM's card fields
    assert cards[0].parent is None
    assert client.models.retrieve("sql").root == str(adapters["sql"])
    r = httpx.get(f"{server.url}/v1/models/chat")  # KServe's readiness route answers adapters too
    assert r.status_code == 200 and r.json()["parent"] == MODEL


def test_model_field_picks_the_adapter_completions_and_chat_equal_the_engine(client, oracle):
    for name in (MODEL, "sql", "chat"):
        want = expect(oracle, PROMPT, None if name == MODEL else name, max_tokens=16, **GREEDY)
        assert completion(client, name) == want.text, name
    prompt = oracle.apply_chat_template(MESSAGES)
    want = expect(oracle, prompt, "chat", max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=12, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert {c.model for c in chunks} == {"chat"}


def test_concurrent_requests_for_base_and_adapters_each_equal_the_engine(server, oracle):
    names = [MODEL, "sql", "chat", "sql", MODEL, "chat"]
    want = {n: expect(oracle, PROMPT, None if n == MODEL else n, max_tokens=20, **GREEDY).text for n in set(names)}

    async def main():
        async with openai.AsyncOpenAI(base_url=server.openai_url, api_key=KEY, max_retries=0, timeout=120) as aclient:
            outs = await asyncio.gather(*(aclient.completions.create(
                model=n, prompt=PROMPT, max_tokens=20, temperature=0.0, extra_body={"ignore_eos": True})
                for n in names))
        return [o.choices[0].text for o in outs]

    assert asyncio.run(main()) == [want[n] for n in names]


def test_unknown_model_is_openais_404_naming_the_models_there_are(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert all(f"`{n}`" in body["message"] for n in (MODEL, "sql", "chat")), body["message"]


def test_v2_infer_takes_lora_name_as_a_parameter(server, oracle):
    want = expect(oracle, PROMPT, "sql", max_tokens=10, **GREEDY).text
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
            "parameters": {"lora_name": "sql", "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [want]
    body["parameters"]["lora_name"] = "nope"
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=60)
    assert r.status_code == 404 and "nope" in r.text and "sql" in r.text, r.text


def test_v2_grpc_infer_takes_lora_name_with_tritonclient(server, oracle):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    want = expect(oracle, PROMPT, "chat", max_tokens=10, **GREEDY).text
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    sampling = json.dumps({"temperature": 0.0, "max_tokens": 10, "ignore_eos": True})  # gRPC holds no doubles
    result = client.infer(MODEL, [text], parameters={"lora_name": "chat", "sampling_parameters": sampling})
    assert [t.decode() for t in result.as_numpy("text_output")] == [want]
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [text], parameters={"lora_name": "nope", "sampling_parameters": sampling})
    assert "NOT_FOUND" in str(err.value.status()) and "nope" in err.value.message()


def test_load_use_and_unload_an_adapter_at_run_time(server, client, oracle, adapters):
    want = expect(oracle, PROMPT, "late", max_tokens=16, **GREEDY).text
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' added successfully.")
    assert "late" in [c.id for c in client.models.list().data]
    assert completion(client, "late") == want
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
    assert "late" not in [c.id for c in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        completion(client, "late")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404  # vLLM's NotFoundError
    assert completion(client, "sql") == expect(oracle, PROMPT, "sql", max_tokens=16, **GREEDY).text


@pytest.mark.parametrize("body, status, needle", [
    ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path'"),
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 404, "No adapter found"),
    ({"lora_name": "x", "lora_path": "/tmp", "adapter": 1}, 400, "unknown field"),
    ({"lora_name": "too-wide", "lora_path": "TOO_WIDE"}, 400, "rank"),
])
def test_bad_loads_get_vllms_statuses_and_the_server_keeps_serving(server, client, oracle, adapters, body, status,
                                                                  needle):
    body = {k: (str(adapters["too-wide"]) if v == "TOO_WIDE" else v) for k, v in body.items()}
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    assert [c.id for c in client.models.list().data] == [MODEL, "sql", "chat"]
    assert completion(client, "chat", 6) == expect(oracle, PROMPT, "chat", max_tokens=6, **GREEDY).text


def test_adapter_routes_need_the_api_key(server, adapters):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}, key=None)
    assert r.status_code == 401
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"}, key="wrong").status_code == 401


def test_a_request_for_an_unloaded_adapter_is_404_while_another_keeps_streaming(server, client, oracle, adapters):
    """A stream of `chat` runs while `late` is loaded, unloaded and asked for: the 404 is that
    request's alone, and the stream ends complete and equal to the engine's."""
    want = expect(oracle, PROMPT, "chat", max_tokens=120, **GREEDY).text
    stream = client.completions.create(model="chat", prompt=PROMPT, max_tokens=120, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    parts = [next(stream).choices[0].text]
    assert post(server, "/v1/load_lora_adapter",
                {"lora_name": "late", "lora_path": str(adapters["late"])}).status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="late", messages=MESSAGES, max_tokens=4)
    parts += [c.choices[0].text for c in stream if c.choices]
    assert "".join(parts) == want


def lora_info(server) -> list[dict[str, str]]:
    """The labels of every vllm:lora_requests_info sample on /metrics (vLLM's, no model_name)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return [dict(s.labels) | {"value": s.value} for f in text_string_to_metric_families(text)
            if f.name == "vllm:lora_requests_info" for s in f.samples]


def test_lora_requests_info_names_the_running_adapters(server, client):
    idle = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    (sample,) = lora_info(server)
    assert {k: sample[k] for k in idle} == idle and set(sample) == {*idle, "value"}  # vLLM's labels only
    assert abs(sample["value"] - time.time()) < 60  # vLLM's value: the time of the update
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=150, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(stream)
    (busy,) = lora_info(server)
    assert {k: busy[k] for k in idle} == {**idle, "running_lora_adapters": "sql"}
    stream.close()
    deadline = time.monotonic() + 10  # the server aborts the request once it sees the client gone
    while lora_info(server)[0]["running_lora_adapters"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {k: lora_info(server)[0][k] for k in idle} == idle


def test_lora_requests_info_names_the_waiting_adapter_beyond_max_loras(server, client, adapters):
    """--max-loras 2: while `sql` and `chat` run, a request for a third adapter waits (the engine's
    rule, as vLLM's), and the metric says so: running "chat,sql", waiting "late"."""
    import threading

    assert post(server, "/v1/load_lora_adapter",
                {"lora_name": "late", "lora_path": str(adapters["late"])}).status_code == 200
    streams = [client.completions.create(model=name, prompt=PROMPT, max_tokens=400, temperature=0.0, stream=True,
                                         extra_body={"ignore_eos": True}) for name in ("sql", "chat")]
    for stream in streams:
        next(stream)
    late: list[str] = []
    waiter = threading.Thread(target=lambda: late.append(completion(client, "late", 4)))
    waiter.start()
    try:
        want = {"max_lora": "2", "running_lora_adapters": "chat,sql", "waiting_lora_adapters": "late"}
        deadline = time.monotonic() + 10
        while {k: lora_info(server)[0][k] for k in want} != want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {k: lora_info(server)[0][k] for k in want} == want
        assert not late  # still waiting for an adapter slot
    finally:
        for stream in streams:
            stream.close()  # their requests end: `late` is admitted
        waiter.join(60)
    assert len(late) == 1
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200


def test_tokenize_takes_an_adapters_name(server):
    ids = [post(server, "/tokenize", {"model": m, "prompt": PROMPT}).json()["tokens"] for m in (MODEL, "sql")]
    assert ids[0] == ids[1] and ids[0]
    assert post(server, "/tokenize", {"model": "nope", "prompt": PROMPT}).status_code == 404


def test_runtime_updating_is_refused_without_the_switch(model_dir):
    """vLLM serves the routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING: without it (or the flag)
    they answer 404 with OpenAI's error shape, saying how to turn them on (no engine needed to tell)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedserve.adapters.kserve.errors import OpenAIError
    from pagedserve.adapters.kserve.served_models import ServedModels, runtime_updating_allowed

    app = FastAPI()
    ServedModels(MODEL, lambda: None, lora_enabled=True, allow_runtime_updating=False).register(app)
    r = TestClient(app).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(model_dir)})
    assert r.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
    # While the engine loads, a name that may be an adapter is a 503 (retry), not a 404.
    with pytest.raises(OpenAIError) as err:
        ServedModels(MODEL, lambda: None, lora_enabled=True).lora_name("sql")
    assert err.value.status == 503
    assert runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not runtime_updating_allowed(False, {})
