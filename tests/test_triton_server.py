"""The Triton adapter on a REAL tritonserver (the nvidia-pytriton wheel), queried with the stock
clients, judged against the engine called in-process with the same model and parameters.

One server per module (started through the launcher's start_server, the code behind
`pagedserve triton`), loopback only, free ports, stopped and its /dev/shm regions removed at the end.
Its model loads tests/server_hooks for the batching tests: a batch log (how many samples each forward
pass gave a token: what the engine batched, told without a clock) and a pace file (slower steps while
a test holds it, so requests sent together reach the engine together on a busy machine).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import threading

import numpy as np
import pytest

from pagedserve.adapters.triton_server.launcher import DEFAULT_REPOSITORY, start_server
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from bench.proctree import process_tree
from tests.harness.local_ports import free_ports
from tests.reliability_helpers import batch_sizes, install_triton_hooks, paced
from tests.triton_helpers import (GrpcStream, grpc_request, http_post, scrape, sse_events, text_inputs,
                                  token_inputs, wait_for)

pytestmark = pytest.mark.timeout(240)

PROMPT = "The paged KV cache hands out blocks"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
VICTIM_TOKENS = 2000  # requests a test cancels midway: seconds of decoding, not the ~0.2 s of 220
SMOLLM2_SETTINGS = {"model": "default", "dtype": "float32", "max_num_seqs": 8, "kv_cache_memory": 64 * 2**20}


@pytest.fixture(scope="module")
def engine_settings(tiny_model_dir):
    return {"model": str(tiny_model_dir("llama")), "dtype": "float32", "max_num_seqs": 16,
            "max_num_batched_tokens": 128, "num_kv_blocks": 256, "max_model_len": 2048}


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_settings):
    """The shipped repository (one model, both contracts) copied to a tmp dir and pointed at a tiny
    model, plus models loaded on demand (explicit model control): one whose engine.json has a
    misspelt key, one serving the embedded SmolLM2, and a second engine restricted to the token
    contract (two engines in one repository, on purpose)."""
    repo = tmp_path_factory.mktemp("triton") / "model_repository"
    shutil.copytree(DEFAULT_REPOSITORY, repo)
    (repo / "pagedserve" / "1" / "engine.json").write_text(json.dumps(engine_settings))
    add_model(repo, "pagedserve_badconfig", {**engine_settings, "blok_size": 16})
    add_model(repo, "pagedserve_smollm2", SMOLLM2_SETTINGS)  # the shipped engine.json's default model
    add_model(repo, "pagedserve_tokens", engine_settings, contract="tokens")
    install_triton_hooks(repo / "pagedserve", 0.0, None, batch_log=repo.parent / "batches.log",  # not the copies
                         pace_file=repo.parent / "pace")
    http, grpc, metrics = free_ports(3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    srv = start_server(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, models=["pagedserve"], env=env,
                       log_path=repo.parent / "tritonserver.log", timeout=180)
    try:
        yield srv
    finally:
        srv.stop()
        assert not glob.glob(f"/dev/shm/{srv.shm_prefix}*")


def add_model(repo, name, settings, contract="auto"):
    """A copy of the shipped model under another name, with its own engine.json (another engine)."""
    shutil.copytree(repo / "pagedserve", repo / name)
    config = (repo / name / "config.pbtxt").read_text().replace('"pagedserve"', f'"{name}"')
    (repo / name / "config.pbtxt").write_text(config.replace('string_value: "auto"', f'string_value: "{contract}"'))
    (repo / name / "1" / "engine.json").write_text(json.dumps(settings))


@pytest.fixture(scope="module")
def oracle(engine_settings):
    """The engine in-process: what the server must reproduce."""
    return LLMEngine(EngineConfig.from_dict(engine_settings))


def engine_text(oracle, prompt, **params):
    return [r.text for r in oracle.generate([prompt], SamplingParams(**params))]


def test_grpc_stream_deltas_equal_nonstreaming_and_engine(server, oracle):
    expected = engine_text(oracle, PROMPT, max_tokens=24, **GREEDY)[0]
    streamed = grpc_request(server.grpc_url, "pagedserve", text_inputs(PROMPT, True, {"max_tokens": 24, **GREEDY}))
    assert streamed.error is None
    assert len(streamed.responses) == 24  # one delta per token: incremental, not one blob
    assert streamed.finals == [False] * 23 + [True]  # FINAL on the last data response
    assert "".join(streamed.texts()) == expected
    assert streamed.times[-1] > streamed.times[0]
    whole = grpc_request(server.grpc_url, "pagedserve", text_inputs(PROMPT, False, {"max_tokens": 24, **GREEDY}))
    assert whole.finals == [True]
    assert whole.texts() == [PROMPT + expected]  # non-streaming: prompt + completion by default
    excluded = grpc_request(server.grpc_url, "pagedserve",
                            text_inputs(PROMPT, False, {"max_tokens": 24, **GREEDY}, exclude_input_in_output=True))
    assert excluded.texts() == [expected]


def test_http_generate_return_flags_and_logprobs(server, oracle):
    params = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    ref = oracle.generate([PROMPT], params)[0]
    body = {"text_input": PROMPT, "exclude_input_in_output": True, "return_finish_reason": True,
            "return_cumulative_logprob": True, "return_logprobs": True, "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "parameters": {"max_tokens": 12, "logprobs": 2, "temperature": 0, "ignore_eos": True}}
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate", body)
    assert status == 200, text
    out = json.loads(text)
    assert out["text_output"] == ref.text
    assert out["finish_reason"] == "length"
    assert out["num_input_tokens"] == len(ref.prompt_token_ids)
    assert out["num_output_tokens"] == 12
    assert out["cumulative_logprob"] == pytest.approx(ref.cumulative_logprob, abs=1e-4)
    logprobs = json.loads(out["logprobs"])
    assert len(logprobs) == 12
    for pos, e in zip(logprobs, ref.logprobs):
        assert pos[str(e.token_id)]["logprob"] == pytest.approx(e.logprob, abs=1e-4)
        assert pos[str(e.token_id)]["rank"] == e.rank
        assert {int(k) for k in pos} == {e.token_id, *(t for t, _ in e.top)}
    # Flags off: only text_output; without logprobs asked, return_logprobs gives JSON null.
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate",
                             {"text_input": PROMPT, "return_logprobs": True, "max_tokens": 3, "temperature": 0})
    assert status == 200 and json.loads(json.loads(text)["logprobs"]) is None


def test_http_sampling_parameters_stop_seed_and_n(server, oracle):
    url = f"http://{server.http_url}/v2/models/pagedserve/generate"
    full = engine_text(oracle, PROMPT, max_tokens=20, **GREEDY)[0]
    stop = full[8:11]  # a stop string the greedy output is known to reach
    expected = oracle.generate([PROMPT], SamplingParams(max_tokens=20, stop=[stop], **GREEDY))[0]
    sp = json.dumps({"max_tokens": 20, "stop": [stop], **GREEDY})
    status, text = http_post(url, {"text_input": PROMPT, "sampling_parameters": sp, "return_finish_reason": True,
                                   "exclude_input_in_output": True})
    assert status == 200, text
    assert json.loads(text)["text_output"] == expected.text and expected.finish_reason == "stop"
    assert json.loads(text)["finish_reason"] == "stop"
    # One stop string as a request parameter, as vllm_backend clients send it in a /generate body.
    status, text = http_post(url, {"text_input": PROMPT, "exclude_input_in_output": True,
                                   "parameters": {"max_tokens": 20, "stop": stop, **GREEDY}})
    assert status == 200 and json.loads(text)["text_output"] == expected.text
    # Seeded sampling, n = 2: one element per sequence, each the engine's seeded sample; vllm_backend
    # clients send numbers as strings, which are accepted for numeric keys.
    sp = json.dumps({"max_tokens": "10", "temperature": "0.8", "seed": 7, "n": 2, "ignore_eos": True})
    refs = oracle.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=2, ignore_eos=True))
    status, text = http_post(url, {"text_input": PROMPT, "sampling_parameters": sp, "exclude_input_in_output": True,
                                   "return_num_output_tokens": True})
    assert status == 200, text
    out = json.loads(text)
    assert out["text_output"] == [r.text for r in refs] and out["num_output_tokens"] == [10, 10]
    assert refs[0].token_ids != refs[1].token_ids  # two different samples, not one repeated


def test_http_generate_stream_sse(server, oracle):
    expected = engine_text(oracle, PROMPT, max_tokens=16, **GREEDY)[0]
    status, body = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate_stream",
                             {"text_input": PROMPT, "stream": True, "return_num_output_tokens": True,
                              "parameters": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}})
    assert status == 200
    events = sse_events(body)
    assert len(events) == 16 and all(e["num_output_tokens"] == 1 for e in events)
    assert "".join(e["text_output"] for e in events) == expected  # streaming: new text only


def batch_log(server):
    return server.log_path.parent / "batches.log"


def pace(server):
    """10 ms a step: a second or two for the batching tests' streams, in which the adapter, however
    starved, hands the engine every request sent together. Unpaced, a tiny model's 200 steps take
    0.1 s on a busy machine: a request sent right after another then arrived when it had finished."""
    return paced(server.log_path.parent / "pace", 0.01)


def test_sixteen_concurrent_streams_are_batched(server, oracle):
    prompts = [f"{PROMPT} {i} " + "abc " * (i % 5) for i in range(16)]
    lengths = [30 + 5 * i for i in range(16)]
    refs = oracle.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths])
    logged = len(batch_sizes(batch_log(server)))
    streams = [GrpcStream(server.grpc_url) for _ in prompts]
    results = [None] * 16
    try:
        with pace(server):
            for s, p, n in zip(streams, prompts, lengths):
                s.send("pagedserve", text_inputs(p, True, {"max_tokens": n, **GREEDY}))

            def collect(i):
                results[i] = streams[i].collect(timeout=120)
            threads = [threading.Thread(target=collect, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        for s in streams:
            s.close()
    for i, res in enumerate(results):
        assert res.error is None, res.error
        assert "".join(res.texts()) == refs[i].text, f"stream {i}"
        assert len(res.responses) == lengths[i] and res.finals[-1]
    # The engine batched them: forward passes gave several of them a token at once. (Sampling the
    # num_requests_running gauge for this missed the batch on a busy machine.)
    sizes = batch_sizes(batch_log(server), since=logged)
    assert sum(sizes) == sum(lengths) and max(sizes) > 1, sizes


def _abort_count(server) -> float:
    return scrape(server.metrics_url).get("pagedserve:request_success_total{finished_reason=abort}", 0.0)


def test_cancelled_grpc_stream_and_closed_sse_free_the_request(server, oracle):
    import http.client

    expected = engine_text(oracle, PROMPT, max_tokens=60, **GREEDY)[0]
    aborts = _abort_count(server)
    other = GrpcStream(server.grpc_url)
    victim = GrpcStream(server.grpc_url)
    try:
        other.send("pagedserve", text_inputs(PROMPT, True, {"max_tokens": 60, **GREEDY}))
        # Long enough that it cannot finish before the cancel lands (the tiny model decodes fast).
        victim.send("pagedserve", text_inputs(PROMPT, True, {"max_tokens": VICTIM_TOKENS, **GREEDY}))
        got = victim.collect(stop_after=3)
        assert len(got.responses) == 3 and not any(got.finals)
        victim.close(cancel=True)
        rest = other.collect(timeout=120)  # the other request continues unharmed
        assert "".join(rest.texts()) == expected and rest.finals[-1]
    finally:
        other.close()
    assert wait_for(lambda: _abort_count(server) == aborts + 1, timeout=15)
    # An SSE client that disconnects midway.
    conn = http.client.HTTPConnection(server.host, server.http_port, timeout=30)
    conn.request("POST", "/v2/models/pagedserve/generate_stream", json.dumps(
        {"text_input": PROMPT, "stream": True, "parameters": {"max_tokens": VICTIM_TOKENS, "temperature": 0,
                                                              "ignore_eos": True}}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()
    assert wait_for(lambda: _abort_count(server) == aborts + 2, timeout=15)
    snap = wait_for(lambda: (s := scrape(server.metrics_url))["pagedserve:kv_cache_usage_perc"] == 0 and s, timeout=15)
    assert snap and snap["pagedserve:num_requests_running"] == 0


@pytest.mark.parametrize("case, body, message", [
    ("malformed JSON", {"text_input": PROMPT, "sampling_parameters": "{max_tokens: 4"},
     "sampling_parameters is not valid JSON"),
    ("unknown key", {"text_input": PROMPT, "sampling_parameters": '{"temprature": 0}'}, "temprature"),
    ("negative max_tokens", {"text_input": PROMPT, "parameters": {"max_tokens": -5}}, "max_tokens=-5"),
    ("too long", {"text_input": "abc " * 3000, "parameters": {"max_tokens": 4}}, "max_model_len"),
])
def test_bad_http_input_is_named_and_server_keeps_serving(server, case, body, message):
    url = f"http://{server.http_url}/v2/models/pagedserve/generate"
    status, text = http_post(url, body)
    assert status == 400, (case, text)
    assert message in json.loads(text)["error"], case
    status, text = http_post(url, {"text_input": PROMPT, "parameters": {"max_tokens": 2}})
    assert status == 200 and json.loads(text)["text_output"].startswith(PROMPT)


def test_bad_grpc_input_non_utf8_and_unknown_key(server, oracle):
    res = grpc_request(server.grpc_url, "pagedserve", text_inputs(b"caf\xe9 \xff", False, {"max_tokens": 4}))
    assert res.error is not None and "UTF-8" in str(res.error)
    res = grpc_request(server.grpc_url, "pagedserve", text_inputs(PROMPT, True, {"max_tokens": 4, "beam": 2}))
    assert res.error is not None and "beam" in str(res.error)
    expected = engine_text(oracle, PROMPT, max_tokens=5, **GREEDY)[0]
    res = grpc_request(server.grpc_url, "pagedserve", text_inputs(PROMPT, True, {"max_tokens": 5, **GREEDY}))
    assert "".join(res.texts()) == expected


def test_token_contract_on_the_same_model_output_ids_equal_engine(server, oracle):
    ids = oracle.tokenize(PROMPT)
    ref = oracle.generate([ids], SamplingParams(max_tokens=12, **GREEDY))[0]
    res = grpc_request(server.grpc_url, "pagedserve", token_inputs(ids, 12))
    assert res.error is None and res.finals == [True]
    result = res.responses[0][0]
    assert result.as_numpy("output_ids").tolist() == [ids + list(ref.token_ids)]
    assert result.as_numpy("sequence_length").tolist() == [len(ids) + 12]
    assert result.as_numpy("text_output") is None  # a token request gets the token contract's outputs only
    res = grpc_request(server.grpc_url, "pagedserve", token_inputs(ids, 12, stream=True))
    assert [t for r, _ in res.responses for t in r.as_numpy("output_ids")[0]] == list(ref.token_ids)
    assert res.finals[-1] and len(res.responses) == 12
    # end_id: the named token ends the sequence and is left out of output_ids.
    end = ref.token_ids[5]
    cut = list(ref.token_ids[: ref.token_ids.index(end)])
    res = grpc_request(server.grpc_url, "pagedserve", token_inputs(
        ids, 12, exclude_input_in_output=(np.array([True]), "BOOL"), end_id=(np.array([end], dtype=np.int32), "INT32")))
    assert res.responses[0][0].as_numpy("output_ids").tolist() == [cut]
    # Over HTTP /generate too: a top-level list naming input_ids becomes that tensor.
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate",
                             {"input_ids": ids, "request_output_len": [12]})
    assert status == 200, text
    assert json.loads(text)["output_ids"] == ids + list(ref.token_ids)


def test_both_contracts_at_once_share_one_engine(server, oracle):
    """Text and token streams in flight together on the one model: each equals the engine, and the
    server runs a single Python backend stub (one engine, one copy of the weights)."""
    ids = oracle.tokenize(PROMPT)
    text_ref = engine_text(oracle, PROMPT, max_tokens=200, **GREEDY)[0]
    token_ref = oracle.generate([ids], SamplingParams(max_tokens=200, **GREEDY))[0]
    logged = len(batch_sizes(batch_log(server)))
    text_stream, token_stream = GrpcStream(server.grpc_url), GrpcStream(server.grpc_url)
    try:
        with pace(server):
            text_stream.send("pagedserve", text_inputs(PROMPT, True, {"max_tokens": 200, **GREEDY}))
            token_stream.send("pagedserve", token_inputs(ids, 200, stream=True))
            text_res, token_res = text_stream.collect(timeout=120), token_stream.collect(timeout=120)
    finally:
        text_stream.close()
        token_stream.close()
    assert "".join(text_res.texts()) == text_ref
    assert [t for r, _ in token_res.responses for t in r.as_numpy("output_ids")[0]] == list(token_ref.token_ids)
    # Both streams were produced by the same forward passes (one engine batching them; told by the
    # engine, not by when the client got the responses), in one stub process.
    sizes = batch_sizes(batch_log(server), since=logged)
    assert sum(sizes) == 400 and 2 in sizes, sizes
    assert backend_stubs(server) == 1


def backend_stubs(server) -> int:
    """Python backend stub processes (one per loaded model instance, each with its own engine)."""
    return sum(name == "triton_python_b" for _, name in process_tree(server.process.pid))


@pytest.mark.parametrize("case, body, message", [
    ("neither prompt", {"parameters": {"max_tokens": 4}}, "send text_input"),
    ("both prompts", {"text_input": PROMPT, "input_ids": [1, 2], "request_output_len": [4]}, "not both"),
    ("token input on a text request", {"text_input": PROMPT, "request_output_len": [4]}, "request_output_len"),
    ("text input on a token request", {"input_ids": [1, 2], "request_output_len": [4], "return_logprobs": True},
     "return_logprobs"),
])
def test_mixing_the_contracts_is_named(server, case, body, message):
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate", body)
    assert status == 400, (case, text)
    assert message in json.loads(text)["error"], case


def test_temperature_input_is_the_text_sampling_key(server, oracle):
    """Triton's /generate turns a "temperature" parameter into the token contract's FP32 input of that
    name; on a text request it is the sampling temperature, and giving it twice is an error."""
    seeded = {"max_tokens": 8, "seed": 11, "ignore_eos": True}
    ref = oracle.generate([PROMPT], SamplingParams(temperature=0.9, **seeded))[0]
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate", {
        "text_input": PROMPT, "exclude_input_in_output": True, "parameters": {"temperature": 0.9, **seeded}})
    assert status == 200 and json.loads(text)["text_output"] == ref.text
    inputs = text_inputs(PROMPT, False, {"temperature": 0.5, "max_tokens": 4})
    import tritonclient.grpc as grpcclient
    temperature = grpcclient.InferInput("temperature", [1], "FP32")
    temperature.set_data_from_numpy(np.array([0.7], dtype=np.float32))
    res = grpc_request(server.grpc_url, "pagedserve", [*inputs, temperature])
    assert res.error is not None and "temperature is given twice" in str(res.error)


def test_a_second_engine_on_purpose_restricted_to_tokens(server, oracle):
    """Two engines in one repository stay possible (a second model directory), never by default."""
    import tritonclient.grpc as grpcclient

    ids = oracle.tokenize(PROMPT)
    ref = oracle.generate([ids], SamplingParams(max_tokens=6, **GREEDY))[0]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.load_model("pagedserve_tokens")
        assert backend_stubs(server) == 2
        res = grpc_request(server.grpc_url, "pagedserve_tokens", token_inputs(ids, 6))
        assert res.responses[0][0].as_numpy("output_ids").tolist() == [ids + list(ref.token_ids)]
        res = grpc_request(server.grpc_url, "pagedserve_tokens", text_inputs(PROMPT, False, {"max_tokens": 4}))
        assert res.error is not None and "token contract only" in str(res.error)
    finally:
        client.unload_model("pagedserve_tokens")
        client.close()
    assert wait_for(lambda: backend_stubs(server) == 1, timeout=30)


def test_metrics_follow_one_request(server, oracle):
    before = scrape(server.metrics_url)
    prompt = "A unique prompt for the metrics check: 0123456789"
    n_prompt = len(oracle.tokenize(prompt))
    grpc_request(server.grpc_url, "pagedserve", text_inputs(prompt, False, {"max_tokens": 9, **GREEDY}))
    key = "pagedserve:e2e_request_latency_seconds_count"
    success = "pagedserve:request_success_total{finished_reason=length}"
    # The exporter updates one metric after another, so a scrape can fall between two of them.
    after = wait_for(lambda: ((s := scrape(server.metrics_url))[key] == before[key] + 1
                              and s.get(success, 0.0) == before.get(success, 0.0) + 1 and s), timeout=10)
    assert after, "the e2e histogram and the success counter did not both count the request"
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["pagedserve:time_to_first_token_seconds_count"] == 1
    assert delta["pagedserve:inter_token_latency_seconds_count"] == 8
    assert delta["pagedserve:generation_tokens_total"] == 9
    assert delta["pagedserve:prompt_tokens_total"] == n_prompt
    assert delta["pagedserve:prefix_cache_queries_total"] >= n_prompt - 1
    assert after['pagedserve:e2e_request_latency_seconds_bucket{le=+Inf}'] == after[key]
    assert delta["pagedserve:e2e_request_latency_seconds_sum"] > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_hits_total"):
        assert f"pagedserve:{name}" in after


def test_bad_engine_json_fails_the_load_naming_the_key(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="blok_size"):
            client.load_model("pagedserve_badconfig")
        assert not client.is_model_ready("pagedserve_badconfig")
        assert client.is_model_ready("pagedserve")
    finally:
        client.close()


@pytest.mark.slow
def test_real_model_chat_text_with_stop_string(server):
    """The embedded SmolLM2 (real text, a multi-byte UTF-8 prompt, the chat template): the server's text equals
    the in-process engine's, streamed or not, and a stop string ends it the same way."""
    import tritonclient.grpc as grpcclient

    oracle = LLMEngine(EngineConfig.from_dict(SMOLLM2_SETTINGS))
    prompt = oracle.apply_chat_template([{"role": "user", "content": "Write the word café three times."}])
    params = {"max_tokens": 24, "temperature": 0, "stop": ["\n\n"]}
    ref = oracle.generate([prompt], SamplingParams(**params))[0]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.load_model("pagedserve_smollm2")
        whole = grpc_request(server.grpc_url, "pagedserve_smollm2",
                             text_inputs(prompt, False, params, exclude_input_in_output=True,
                                         return_finish_reason=True))
        streamed = grpc_request(server.grpc_url, "pagedserve_smollm2", text_inputs(prompt, True, params))
    finally:
        client.unload_model("pagedserve_smollm2")
        client.close()
    assert whole.texts() == [ref.text] and ref.text.strip()
    assert whole.responses[0][0].as_numpy("finish_reason")[0].decode() == ref.finish_reason
    assert "".join(streamed.texts()) == ref.text
