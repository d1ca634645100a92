from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
