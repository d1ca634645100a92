"""Start and stop a real `pagedserve kserve` ModelServer in a subprocess, for the KServe tests.

The test process never imports kserve (it cannot share a process with tritonclient.grpc, which
the Triton tests import in the same pytest run): the server runs in its own interpreter, bound to
loopback on free ports, with one intra-op thread (CPU contention, see conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_chat_template(src: Path, dst: Path) -> Path:
    """A copy of a tiny model whose tokenizer has a simple ChatML template."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class KServeServer:
    proc: subprocess.Popen
    model_name: str
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def openai_url(self) -> str:
        return f"{self.url}/openai/v1"

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(model: Path | str, log_path: Path, model_name: str = "tiny", extra_args: tuple[str, ...] = (),
                 timeout: float = 120.0) -> KServeServer:
    """Launch the server and wait until /v2/models/<name>/ready answers 200 (engine warmed up)."""
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "pagedserve.core.cli", "kserve", "--model", str(model), "--dtype", "float32",
           "--model-name", model_name, "--host", "127.0.0.1", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), *extra_args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    server = KServeServer(proc, model_name, http_port, grpc_port, log_path)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the kserve server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/v2/models/{model_name}/ready", timeout=2).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the kserve server was not ready after {timeout}s:\n{server.log_tail()}")
            time.sleep(0.25)
    except BaseException:
        server.stop()
        raise


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def engine_value(samples: dict, name: str, model: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model": model, "version": "1", **labels}.items())))
    return samples.get(key, 0.0)
