"""The KServe adapter's Open Inference Protocol side, end to end against a real ModelServer
(a subprocess): v2 infer over HTTP and gRPC with the stock tritonclient, v1 :predict, health and
readiness, /metrics, and the CLI's own errors. Outputs are checked against the in-process engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pagedserve.adapters.engine_metrics import ENGINE_METRICS, MetricKind
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.kserve_server import engine_value, scrape, start_server

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
PROMPTS = ["The paged KV cache", "Continuous batching rebuilds the batch"]
PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(tiny_model_dir("llama"), tmp_path_factory.mktemp("kserve-v2-log") / "server.log", MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32"}))


@pytest.fixture(scope="module")
def expected(oracle):
    return [r.text for r in oracle.generate(PROMPTS, SamplingParams(**PARAMS))]


def _text_input(module, n: int):
    inp = module.InferInput("text_input", [n], "BYTES")
    inp.set_data_from_numpy(np.array([p.encode() for p in PROMPTS[:n]], dtype=np.object_))
    return inp


def test_health_readiness_and_metadata(server):
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready", f"/v1/models/{MODEL}"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200, path
    meta = httpx.get(f"{server.url}/v2/models/{MODEL}", timeout=10).json()
    assert meta["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]
    assert httpx.get(f"{server.url}/v2/models/other/ready", timeout=10).status_code == 404


def test_v2_infer_over_http_with_tritonclient(server, expected):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    result = client.infer(MODEL, [_text_input(httpclient, 2)], parameters=PARAMS)
    assert [t.decode() for t in result.as_numpy("text_output")] == expected


def test_v2_infer_over_grpc_with_tritonclient(server, expected):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert client.is_model_ready(MODEL)
    # kserve's gRPC parameters hold no doubles: floats travel in the JSON string sampling_parameters
    result = client.infer(MODEL, [_text_input(grpcclient, 2)],
                          parameters={"max_tokens": 8, "sampling_parameters": json.dumps({"temperature": 0.0}),
                                      "ignore_eos": True})
    assert [t.decode() for t in result.as_numpy("text_output")] == expected
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [_text_input(grpcclient, 1)], parameters={"temperature": 0.5})
    assert "'temperature' arrived without a value" in err.value.message()
    bad = grpcclient.InferInput("text_input", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [bad], parameters={"max_tokens": -2})
    assert "INVALID_ARGUMENT" in str(err.value.status()) and "max_tokens=-2" in err.value.message()
    assert client.infer(MODEL, [bad], parameters={"max_tokens": 2}).as_numpy("text_output").shape == (1,)


def test_v1_predict(server, expected):
    r = httpx.post(f"{server.url}/v1/models/{MODEL}:predict", json={"instances": PROMPTS, "parameters": PARAMS},
                   timeout=60)
    assert r.status_code == 200 and r.json() == {"predictions": expected}


def test_v1_predict_with_n_samples_returns_one_prediction_per_sample(server, oracle):
    params = {"n": 2, "seed": 5, "temperature": 0.8, "max_tokens": 6}
    r = httpx.post(f"{server.url}/v1/models/{MODEL}:predict", json={"instances": PROMPTS, "parameters": params},
                   timeout=60)
    want = oracle.generate(PROMPTS, SamplingParams(**params))  # prompt-major: p0 s0, p0 s1, p1 s0, p1 s1
    assert r.status_code == 200 and r.json()["predictions"] == [w.text for w in want]


@pytest.mark.parametrize("body,needle", [
    ({"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}, "text_input"),
    ({"inputs": [{"name": "text_input", "datatype": "INT32", "shape": [1], "data": [3]}]}, "BYTES"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
      "parameters": {"temperature": "hot"}}, "temperature"),
    ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
      "parameters": {"max_token": 3}}, "max_token"),
])
def test_v2_bad_input_is_a_400_and_the_server_keeps_serving(server, body, needle):
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"], r.text
    ok = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
          "parameters": {"max_tokens": 2}}
    assert httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=ok, timeout=30).status_code == 200


def test_metrics_export_the_shared_engine_table(server):
    before = scrape(server.url)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    client.infer(MODEL, [_text_input(httpclient, 1)], parameters={"max_tokens": 7, "ignore_eos": True})
    after = scrape(server.url)

    def delta(name, **labels):
        return engine_value(after, name, MODEL, **labels) - engine_value(before, name, MODEL, **labels)

    names = {name for name, _ in after}
    for m in ENGINE_METRICS:
        exported = {MetricKind.GAUGE: m.name, MetricKind.COUNTER: m.name, MetricKind.HISTOGRAM: m.name + "_count"}
        assert exported[m.kind] in names, m.name
    assert delta("pagedserve:generation_tokens_total") == 7
    assert delta("pagedserve:request_success_total", finished_reason="length") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"pagedserve:{hist}_count") == 1
        assert engine_value(after, f"pagedserve:{hist}_bucket", MODEL, le="+Inf") == \
            engine_value(after, f"pagedserve:{hist}_count", MODEL)
    assert delta("pagedserve:inter_token_latency_seconds_count") == 6  # 7 tokens, 6 gaps
    assert engine_value(after, "pagedserve:num_requests_running", MODEL) == 0


WARMUP_CHECK = """
import asyncio, sys
from pagedserve.adapters.kserve.model import PagedServeModel
from pagedserve.core.config import EngineConfig

model = PagedServeModel("m", EngineConfig.from_dict({"model": sys.argv[1], "dtype": "float32"}))

async def main():
    before = (model.ready, await model.healthy(), model.warm_engine())
    await model.start_engine()
    after = (await model.healthy(), model.warm_engine() is model.llm, model.llm.metrics.generation_tokens_total)
    model.stop()
    print(before, after, await model.healthy())

asyncio.run(main())
"""


def test_model_is_healthy_only_after_the_engine_warmed_up(tiny_model_dir):
    # kserve registers a model only if `ready` at start; probes then see healthy(), which must stay
    # false until start_engine() has loaded the engine and generated once. kserve is imported
    # in a child interpreter (it cannot share this process with tritonclient.grpc).
    proc = subprocess.run([sys.executable, "-c", WARMUP_CHECK, str(tiny_model_dir("llama"))],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "(True, False, None) (True, True, 1) False"


def test_cli_rejects_a_bad_engine_flag_before_starting(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tools.cli", "kserve", "--model",
                           str(tiny_model_dir("llama")), "--block-size", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "block_size=0" in proc.stderr and "Traceback" not in proc.stderr
