"""The engine settings of a Triton model: `engine.json` beside model.py, read strictly.

Like vllm_backend's model.json, but validated by EngineConfig.from_dict: an unknown key, a wrong
type or an out-of-range value fails the model load with a message naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.core.config import EngineConfig

ENGINE_JSON = "engine.json"
MODEL_OVERRIDE_ENV = "PAGEDSERVE_TRITON_MODEL"
"""Set by `pagedserve triton --model`: replaces the "model" key of every engine.json it serves."""
SHUTDOWN_NOTICE_ENV = "PAGEDSERVE_TRITON_SHUTDOWN_NOTICE"
"""Set by `pagedserve triton` (launcher.py): a file it creates the moment it passes SIGTERM or
SIGINT on to tritonserver, so that its models start draining at once (server_watch.py says why
they cannot rely on Triton to tell them in time)."""


def load_engine_config(path: Path, model_override: str | None = None) -> EngineConfig:
    return EngineConfig.from_json_file(path, {"model": model_override} if model_override else None)
