"""`pagedserve triton --enable-lora --lora-modules name=path ...`: the LoRA flags `pagedserve kserve`
takes, written into the model repository the launcher serves, where a Triton model reads them
(engine_config.py): vLLM's LoRA settings into each model's engine.json, the adapters into
`multi_lora.json` beside it (vllm_backend's file). The shipped repository is never edited: the
launcher serves a copy of it then (launcher.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedserve.adapters.triton_server.engine_config import ENGINE_JSON, MULTI_LORA_JSON
from pagedserve.core.errors import ConfigError
from pagedserve.tools.engine_args import add_lora_args, parse_lora_modules

LORA_SETTINGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
"""The engine.json keys the flags set (the adapters go to multi_lora.json)."""

__all__ = ["add_lora_args", "lora_settings_from_args", "write_lora_settings"]


def lora_settings_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]] | None:
    """(engine.json settings, adapters: name -> absolute directory) from the flags; None when no LoRA
    flag was given. Raises SystemExit naming a flag that needs --enable-lora."""
    settings = {key: getattr(args, key) for key in LORA_SETTINGS if getattr(args, key, None) is not None}
    try:
        modules = parse_lora_modules(args.lora_modules) if args.lora_modules else {}
    except ConfigError as exc:
        raise SystemExit(f"pagedserve triton: {exc}") from None
    if not settings and not modules:
        return None
    if not settings.get("enable_lora"):
        given = [f"--{k.replace('_', '-')}" for k in settings] + (["--lora-modules"] if modules else [])
        raise SystemExit(f"pagedserve triton: {', '.join(given)} need(s) --enable-lora")
    return settings, {name: str(Path(path).resolve()) for name, path in modules.items()}


def write_lora_settings(repository: Path, settings: dict[str, Any], modules: dict[str, str],
                        models: list[str] | None = None) -> list[Path]:
    """Set `settings` in the engine.json of every model in `repository` (or only `models`) and,
    when `modules` names adapters, write them as multi_lora.json beside it. Returns the files written."""
    written = []
    for engine_json in sorted(repository.glob(f"*/*/{ENGINE_JSON}")):
        if models and engine_json.parent.parent.name not in models:
            continue
        data = json.loads(engine_json.read_text(encoding="utf-8"))
        section = data.get("lora") if isinstance(data.get("lora"), dict) else data
        if modules and "lora_modules" in section:
            raise SystemExit(f"pagedserve triton: {engine_json} names its own adapters (lora_modules); give them "
                             f"there or with --lora-modules, not both")
        section.update(settings)
        engine_json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        written.append(engine_json)
        if modules:
            multi_lora = engine_json.parent / MULTI_LORA_JSON
            multi_lora.write_text(json.dumps(modules, indent=2) + "\n", encoding="utf-8")
            written.append(multi_lora)
    if not written:
        raise SystemExit(f"pagedserve triton: no model with an {ENGINE_JSON} in {repository} to serve LoRA adapters")
    return written
