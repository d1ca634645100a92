"""Helpers for the KServe tests: a real `pagedserve kserve` server in a subprocess (the test
process never imports kserve: it cannot share a process with tritonclient.grpc, which the Triton
tests import in the same pytest run), a tiny model with a chat template, and /metrics scraping."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx

from tests.harness import ONE_THREAD
from tests.harness.kserve_launch import KServeProcess, start_kserve

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


def start_server(model: Path, log_path: Path, model_name: str, env: dict[str, str] | None = None,
                 timeout: float = 120) -> KServeProcess:
    """`env`: more environment for the server (the test hooks' variables)."""
    return start_kserve(model, log_path, model_name, args=("--dtype", "float32"), env={**ONE_THREAD, **(env or {})},
                        timeout=timeout)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def engine_value(samples: dict, name: str, model: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model": model, "version": "1", **labels}.items())))
    return samples.get(key, 0.0)
