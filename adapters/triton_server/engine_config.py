"""The engine settings of a Triton model: `engine.json` beside model.py, read strictly.

Like vllm_backend's model.json, but validated by EngineConfig.from_dict: an unknown key, a wrong
type or an out-of-range value fails the model load with a message naming the file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.core.config import EngineConfig
from pagedserve.core.errors import ConfigError

ENGINE_JSON = "engine.json"
MODEL_OVERRIDE_ENV = "PAGEDSERVE_TRITON_MODEL"
"""Set by `pagedserve triton --model`: replaces the "model" key of every engine.json it serves."""


def load_engine_config(path: Path, model_override: str | None = None) -> EngineConfig:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: engine config file not found; put the engine settings "
                          '(e.g. {"model": "default"}) in a JSON file beside model.py') from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if model_override and isinstance(data, dict):
        data["model"] = model_override
    try:
        return EngineConfig.from_dict(data, what=str(path))
    except ConfigError as exc:
        if str(path) in str(exc):
            raise
        # Range checks inside the config sections name the key but not the file: add it.
        raise ConfigError(f"{path}: {exc}") from None
