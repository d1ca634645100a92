from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.harness.kserve_launch import start_kserve
from tests.harness import ONE_THREAD
from tests.tiny_models import build_tiny_model

# One intra-op thread: the test models are tiny, and OpenMP's thread hand-off costs far more than
# it saves on them; with servers started by other tests beside this process (2 cores) a second
# thread makes small matmuls up to 1000x slower.
torch.set_num_threads(1)
# The same for every engine the tests start, here and in the servers they launch (the variable is
# inherited): an engine otherwise sets its own count from the CPUs it may use (core/cpu_threads.py).
os.environ.setdefault("PAGEDSERVE_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """family -> path of a saved tiny random model (built once per session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def smollm2_kserve(tmp_path_factory):
    """A real kserve ModelServer serving the embedded SmolLM2 in fp32, shared by the slow tests of
    the OpenAI routes (structured output, forced tool calls): each start costs ~20 s of CI."""
    srv = start_kserve("default", tmp_path_factory.mktemp("smollm2-kserve") / "server.log", "smollm2",
                       args=("--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "64",
                             "--kv-cache-memory", str(512 * 2**20)),
                       env=ONE_THREAD, timeout=300)
    yield srv
    srv.stop()
