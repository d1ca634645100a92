"""Installed as users install it: a wheel built from this checkout, pip-installed (not editable) into
a virtualenv outside the checkout, serves through both launchers, run as commands from elsewhere.

To stay fast and offline the new virtualenv reuses this environment's installed dependencies (a
.pth line naming its site-packages; the editable pagedserve there is not activated, since .pth files
are only read in site directories), and pip installs the wheel with its extras from no index: a
dependency the wheel declares that this environment lacks would fail the install, nothing is
downloaded, torch is never reinstalled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from bench.proctree import process_tree
from tests.harness import ONE_THREAD
from tests.harness.readiness import wait_until_ready
from tests.harness.local_ports import free_ports
from tests.triton_helpers import grpc_request, text_inputs, token_inputs

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The paged KV cache hands out blocks"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def run(cmd, **kwargs) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy: setuptools writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.pyc", "build", "dist",
                                                             "*.egg-info", ".pytest_cache", "tests", "bench"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps", "--no-build-isolation",
         "-w", tmp / "dist", src])
    (wheel,) = (tmp / "dist").glob("pagedserve-*.whl")
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    site = Path(run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    (site / "_pagedserve_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-index",
         f"{wheel}[triton,kserve]"])
    work = tmp / "elsewhere"
    work.mkdir()
    where = run([venv / "bin" / "python", "-c", "import pagedserve.core.engine as e; print(e.__file__)"], cwd=work)
    assert Path(where.strip()).is_relative_to(site), where  # the wheel's copy, not this checkout
    return venv / "bin", work


def stop(proc: subprocess.Popen, sig: signal.Signals) -> None:
    tree = process_tree(proc.pid)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    finally:
        survivors = dict(process_tree(1))
        for pid, name in tree[1:]:
            if survivors.get(pid) == name:
                os.kill(pid, signal.SIGKILL)


def test_wheel_serves_triton_from_the_packaged_repository_and_a_written_copy(installed, tiny_model_dir, tmp_path):
    """Both contracts on the one model, from the repository inside the wheel and from a copy
    written by --write-repository whose engine.json was edited (fp32 instead of the shipped auto)."""
    bin_dir, work = installed
    model = tiny_model_dir("llama")
    repo = tmp_path / "repo"
    out = run([bin_dir / "pagedserve", "triton", "--write-repository", repo], cwd=work)
    assert f"--model-repository {repo}" in out
    assert sorted(p.name for p in repo.iterdir()) == ["pagedserve"]  # one model: one engine by default
    engine_json = repo / "pagedserve" / "1" / "engine.json"
    engine_json.write_text(json.dumps({**json.loads(engine_json.read_text()), "dtype": "float32"}))
    for repository_args, dtype in (([], "auto"), (["--model-repository", str(repo)], "float32")):
        oracle = LLMEngine(EngineConfig.from_dict({"model": str(model), "dtype": dtype}))
        ids = oracle.tokenize(PROMPT)
        expected_text = oracle.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY))[0].text
        expected_ids = list(oracle.generate([ids], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids)
        http, grpc, metrics = free_ports(3)
        log = tmp_path / "triton.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([bin_dir / "pagedserve", "triton", "--model", str(model), "--http-port", str(http),
                                     "--grpc-port", str(grpc), "--metrics-port", str(metrics), *repository_args],
                                    cwd=work, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ONE_THREAD})
        try:
            wait_until_ready(proc, f"http://127.0.0.1:{http}/v2/models/pagedserve/ready", "the installed server",
                             lambda: log.read_text()[-4000:], timeout=240)
            assert sum(name == "triton_python_b" for _, name in process_tree(proc.pid)) == 1
            url = f"127.0.0.1:{grpc}"
            text = grpc_request(url, "pagedserve", text_inputs(PROMPT, True, {"max_tokens": 8, **GREEDY}))
            tokens = grpc_request(url, "pagedserve", token_inputs(ids, 8))
        finally:
            stop(proc, signal.SIGINT)
        assert "".join(text.texts()) == expected_text, repository_args
        assert tokens.responses[0][0].as_numpy("output_ids").tolist() == [ids + expected_ids], repository_args


def test_wheel_serves_kserve(installed, tiny_model_dir, tmp_path):
    bin_dir, work = installed
    model = tiny_model_dir("llama")
    expected = LLMEngine(EngineConfig.from_dict({"model": str(model), "dtype": "float32"})).generate(
        [PROMPT], SamplingParams(max_tokens=8, **GREEDY))[0]
    http, grpc = free_ports(2)
    log = tmp_path / "kserve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([bin_dir / "pagedserve", "kserve", "--model", str(model), "--model-name", "tiny",
                                 "--dtype", "float32", "--host", "127.0.0.1", "--http-port", str(http),
                                 "--grpc-port", str(grpc)],
                                cwd=work, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ONE_THREAD})
    try:
        wait_until_ready(proc, f"http://127.0.0.1:{http}/v2/models/tiny/ready", "the installed server",
                         lambda: log.read_text()[-4000:], timeout=240)
        resp = httpx.post(f"http://127.0.0.1:{http}/openai/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 8, **GREEDY})
    finally:
        stop(proc, signal.SIGTERM)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == expected.text
