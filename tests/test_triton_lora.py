"""Multi-LoRA on Triton (issue 34), end to end: `pagedserve triton --enable-lora --lora-modules ...`
(the real launcher, in a subprocess) writes vllm_backend's files into the repository and serves
it on the real tritonserver; tritonclient picks adapters by `lora_name`: in sampling_parameters
(vllm_backend's text contract) and as the token contract's input.

Oracle: the core engine in-process with the same model and adapters (LLMEngine.generate with the
same lora_name); the adapters are random with non-zero B, saved by PEFT (tests/lora_oracle.py), and differ from the base model and each
other (tests/test_kserve_lora.py checks that of the oracle)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from pagedserve.adapters.child_process import stop_process
from pagedserve.adapters.triton_server.engine_config import MULTI_LORA_JSON, load_engine_config
from pagedserve.adapters.triton_server.launcher import write_repository
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import ConfigError
from pagedserve.core.sampling_params import SamplingParams

from tests.harness import ONE_THREAD
from tests.harness.local_ports import free_ports
from tests.harness.readiness import wait_until_ready
from tests.lora_oracle import make_adapter
from tests.reliability_helpers import install_triton_hooks
from tests.triton_helpers import GrpcStream, grpc_request, http_post, text_inputs, token_inputs, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = "The paged KV cache hands out fixed-size blocks"
GREEDY = dict(temperature=0.0, ignore_eos=True)
STD = 0.1
"""Of the adapters' random A and B: large enough that each changes the tiny model's greedy tokens."""
STEP_DELAY_S = 0.01


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-lora-adapters")
    return {"sql": make_adapter(model_dir, root / "sql", seed=1, std=STD),
            "chat": make_adapter(model_dir, root / "chat", seed=2, std=STD, targets=("q_proj", "v_proj"))}


class LauncherServer:
    """`pagedserve triton` as an operator runs it: a child process on free loopback ports."""

    def __init__(self, repository, adapters, log_path) -> None:
        self.http, self.grpc, self.metrics = free_ports(3)
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagedserve.tools.cli", "triton", "--model-repository", str(repository),
               "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
               "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
               "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ONE_THREAD})
        try:
            wait_until_ready(self.proc, f"http://127.0.0.1:{self.http}/v2/models/pagedserve/ready",
                             "pagedserve triton", self.log_tail, 300)
        except BaseException:
            self.stop()
            raise

    grpc_url = property(lambda self: f"127.0.0.1:{self.grpc}")
    http_url = property(lambda self: f"127.0.0.1:{self.http}")

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 60, kill_timeout=10)  # the launcher stops tritonserver


@pytest.fixture(scope="module")
def repository(model_dir, tmp_path_factory):
    repo = write_repository(tmp_path_factory.mktemp("triton-lora") / "model_repository")
    (repo / "pagedserve" / "1" / "engine.json").write_text(json.dumps({"model": str(model_dir), "dtype": "float32"}))
    install_triton_hooks(repo / "pagedserve", STEP_DELAY_S, None)
    return repo


@pytest.fixture(scope="module")
def server(repository, adapters, tmp_path_factory):
    srv = LauncherServer(repository, adapters, tmp_path_factory.mktemp("triton-lora-log") / "launcher.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle(model_dir, adapters):
    return LLMEngine(EngineConfig.from_dict({
        "model": str(model_dir), "dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
        "lora_modules": {name: str(path) for name, path in adapters.items()}}))


def expect(oracle, prompt, lora_name, **params):
    (result,) = oracle.generate([prompt], SamplingParams(**params), lora_name=lora_name)
    return result


def test_the_launcher_wrote_vllm_backends_files_into_the_repository(server, repository, adapters):
    version = repository / "pagedserve" / "1"
    settings = json.loads((version / "engine.json").read_text())
    assert {k: settings[k] for k in ("enable_lora", "max_loras", "max_lora_rank")} == {
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    assert json.loads((version / MULTI_LORA_JSON).read_text()) == {n: str(p) for n, p in adapters.items()}


def test_lora_name_in_sampling_parameters_picks_the_adapter(server, oracle):
    for name in (None, "sql", "chat"):
        want = expect(oracle, PROMPT, name, max_tokens=16, **GREEDY).text
        sampling = {"max_tokens": 16, **GREEDY, **({"lora_name": name} if name else {})}
        res = grpc_request(server.grpc_url, "pagedserve", text_inputs(PROMPT, True, sampling))
        assert res.error is None and "".join(res.texts()) == want, name
    # /generate: vllm_backend's clients put it in "parameters"
    want = expect(oracle, PROMPT, "sql", max_tokens=8, **GREEDY).text
    status, text = http_post(f"http://{server.http_url}/v2/models/pagedserve/generate",
                             {"text_input": PROMPT, "exclude_input_in_output": True,
                              "parameters": {"lora_name": "sql", "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True}})
    assert status == 200 and json.loads(text)["text_output"] == want, text


def test_token_contract_lora_name_input(server, oracle):
    ids = oracle.tokenize(PROMPT)
    want = expect(oracle, ids, "chat", max_tokens=12, **GREEDY)
    lora = (np.array([b"chat"], dtype=np.object_), "BYTES")
    res = grpc_request(server.grpc_url, "pagedserve", token_inputs(ids, 12, lora_name=lora))
    assert res.error is None
    assert res.responses[0][0].as_numpy("output_ids").tolist() == [ids + list(want.token_ids)]


def test_unknown_adapter_is_a_clear_error_while_another_stream_continues(server, oracle):
    want = expect(oracle, PROMPT, "sql", max_tokens=100, **GREEDY).text
    long = GrpcStream(server.grpc_url)
    try:
        long.send("pagedserve", text_inputs(PROMPT, True, {"max_tokens": 100, "lora_name": "sql", **GREEDY}))
        first = long.collect(timeout=60, stop_after=1)
        assert first.error is None and len(first.responses) == 1
        bad = grpc_request(server.grpc_url, "pagedserve",
                           text_inputs(PROMPT, True, {"max_tokens": 4, "lora_name": "nope", **GREEDY}))
        assert bad.error is not None
        assert "nope" in str(bad.error) and "sql" in str(bad.error) and "chat" in str(bad.error), str(bad.error)
        rest = long.collect(timeout=60)
        assert rest.error is None and rest.finals[-1]
        assert "".join(first.texts() + rest.texts()) == want
    finally:
        long.close()


def lora_info(server) -> list[dict[str, str]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [dict(s.labels) for f in text_string_to_metric_families(text)
            if f.name == "vllm:lora_requests_info" for s in f.samples]


def test_lora_requests_info_on_the_metrics_port(server):
    """One sample, vLLM's labels beside Triton's model and version: idle, then naming the adapter of
    a running stream (the exporter refreshes every 0.2 s, so the test waits for it)."""
    idle = {"model": "pagedserve", "version": "1", "max_lora": "2", "running_lora_adapters": "",
            "waiting_lora_adapters": ""}
    assert wait_for(lambda: lora_info(server) == [idle]), lora_info(server)
    stream = GrpcStream(server.grpc_url)
    try:
        stream.send("pagedserve", text_inputs(PROMPT, True, {"max_tokens": 150, "lora_name": "chat", **GREEDY}))
        stream.collect(timeout=60, stop_after=1)
        busy = {**idle, "running_lora_adapters": "chat"}
        assert wait_for(lambda: lora_info(server) == [busy]), lora_info(server)
        stream.client.stop_stream(cancel_requests=True)
    finally:
        stream.close()
    assert wait_for(lambda: lora_info(server) == [idle]), lora_info(server)


def test_vllm_backends_model_json_form_and_multi_lora_json(tmp_path, adapters):
    """engine.json as vllm_backend's model.json spells LoRA ("enable_lora": "true"), multi_lora.json
    beside it with a relative path; LoRA on without the file is an error naming it."""
    (tmp_path / "engine.json").write_text(json.dumps({"model": "default", "enable_lora": "true", "max_lora_rank": 8}))
    (tmp_path / "loras").symlink_to(adapters["sql"].parent)
    (tmp_path / MULTI_LORA_JSON).write_text(json.dumps({"sql": "loras/sql"}))
    config = load_engine_config(tmp_path / "engine.json")
    assert config.lora.enable_lora and config.lora.max_lora_rank == 8
    assert config.lora.lora_modules == {"sql": str((tmp_path / "loras" / "sql").resolve())}
    (tmp_path / MULTI_LORA_JSON).unlink()
    with pytest.raises(ConfigError, match=MULTI_LORA_JSON):
        load_engine_config(tmp_path / "engine.json")
    (tmp_path / "engine.json").write_text(json.dumps({"model": "default", "enable_lora": "false"}))
    assert not load_engine_config(tmp_path / "engine.json").lora.enable_lora



def test_the_launchers_lora_flags_need_enable_lora_and_respect_a_lora_section(tmp_path, adapters):
    """write_lora_settings edits a "lora" object where engine.json has one, refuses adapters named
    both in engine.json and by --lora-modules, and LoRA flags without --enable-lora stop the command."""
    from pagedserve.adapters.triton_server.launcher import build_parser
    from pagedserve.adapters.triton_server.lora_repository import lora_settings_from_args, write_lora_settings

    with pytest.raises(SystemExit, match="--enable-lora"):
        lora_settings_from_args(build_parser().parse_args(["--lora-modules", f"sql={adapters['sql']}"]))
    assert lora_settings_from_args(build_parser().parse_args([])) is None
    settings, modules = lora_settings_from_args(build_parser().parse_args(
        ["--enable-lora", "--max-loras", "3", "--lora-modules", f"sql={adapters['sql']}"]))
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (version / "engine.json").write_text(json.dumps({"model": "default", "lora": {"max_lora_rank": 8}}))
    write_lora_settings(tmp_path, settings, modules)
    assert json.loads((version / "engine.json").read_text()) == {
        "model": "default", "lora": {"max_lora_rank": 8, "enable_lora": True, "max_loras": 3}}
    assert load_engine_config(version / "engine.json").lora.lora_modules == {"sql": str(adapters["sql"])}
    (version / "engine.json").write_text(json.dumps({"model": "default", "lora_modules": {"a": "/a"}}))
    with pytest.raises(SystemExit, match="not both"):
        write_lora_settings(tmp_path, settings, modules)
