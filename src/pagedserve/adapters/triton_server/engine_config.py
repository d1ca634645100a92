"""The engine settings of a Triton model: `engine.json` beside model.py, read strictly, and the
LoRA adapters of `multi_lora.json` beside it.

Like vllm_backend's model.json, but validated by EngineConfig.from_dict: an unknown key, a wrong
type or an out-of-range value fails the model load with a message naming the file and the key.

LoRA as vllm_backend takes it (docs/lora.md): `"enable_lora": true` in engine.json (vLLM's other
LoRA settings too: max_loras, max_lora_rank, max_cpu_loras; flat, as model.json has them, or under
"lora"), and `multi_lora.json` in the same directory mapping each adapter's name to its PEFT
directory. vllm_backend's quirks are kept: "enable_lora" may be the string "true" or "false",
multi_lora.json is required when LoRA is on (unless engine.json names its adapters itself, as
`lora_modules`) and ignored when it is off. A relative path in multi_lora.json is taken from the
file's own directory (vllm_backend leaves it to the server's working directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.core.config import EngineConfig
from pagedserve.core.errors import ConfigError
from pagedserve.core.validation import parse_json_object

ENGINE_JSON = "engine.json"
MULTI_LORA_JSON = "multi_lora.json"
"""vllm_backend's file of LoRA adapters (name -> PEFT directory), beside engine.json."""
MODEL_OVERRIDE_ENV = "PAGEDSERVE_TRITON_MODEL"
"""Set by `pagedserve triton --model`: replaces the "model" key of every engine.json it serves."""
SHUTDOWN_NOTICE_ENV = "PAGEDSERVE_TRITON_SHUTDOWN_NOTICE"
"""Set by `pagedserve triton` (launcher.py): a file it creates the moment it passes SIGTERM or
SIGINT on to tritonserver, so that its models start draining at once (server_watch.py says why
they cannot rely on Triton to tell them in time)."""


def load_engine_config(path: Path, model_override: str | None = None) -> EngineConfig:
    overrides: dict[str, Any] = {"model": model_override} if model_override else {}
    settings = _read_settings(path)
    lora = settings.get("lora") if isinstance(settings.get("lora"), dict) else settings
    enable = lora.get("enable_lora")
    if isinstance(enable, str) and enable.lower() in ("true", "false"):  # vllm_backend's "enable_lora": "true"
        enable = enable.lower() == "true"
        if lora is settings:
            overrides["enable_lora"] = enable
    if enable is True:
        modules = read_multi_lora(path.parent / MULTI_LORA_JSON)
        if modules is not None:
            if "lora_modules" in lora:
                raise ConfigError(f"{path} names LoRA adapters (lora_modules) and so does "
                                  f"{path.parent / MULTI_LORA_JSON}; list them in one of the two", param="lora_modules")
            overrides["lora_modules"] = modules
        elif "lora_modules" not in lora:
            raise ConfigError(f"{path} sets enable_lora but there is no {MULTI_LORA_JSON} beside it: write "
                              f'{path.parent / MULTI_LORA_JSON} as {{"adapter-name": "/path/to/peft-adapter"}} '
                              "(as Triton's vllm_backend), or set enable_lora to false")
    return EngineConfig.from_json_file(path, overrides or None)


def _read_settings(path: Path) -> dict[str, Any]:
    """engine.json's object, for the LoRA keys (EngineConfig.from_json_file reads it again strictly
    and reports every other problem, a missing file included)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_multi_lora(path: Path) -> dict[str, str] | None:
    """multi_lora.json's adapters (name -> directory, relative ones from the file's directory), or
    None when there is no such file. Raises ConfigError naming the file and the entry."""
    if not path.is_file():
        return None
    fix = 'it holds one object such as {"sql": "/adapters/sql-lora"}'
    data = parse_json_object(path.read_text(encoding="utf-8"), ConfigError, str(path), fix)
    modules = {}
    for name, target in data.items():
        if not name or not isinstance(target, str) or not target:
            raise ConfigError(f"{path}: {name!r} -> {target!r}: each entry maps an adapter name to its PEFT "
                              f"directory; {fix}", param="lora_modules")
        modules[name] = str((path.parent / target).resolve()) if not Path(target).is_absolute() else target
    return modules
