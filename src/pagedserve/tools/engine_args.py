"""The engine's command-line flags, shared by every command that starts an engine (`pagedserve
generate`, `pagedserve kserve`, `pagedserve run-batch`, `pagedserve tune`), so each flag is
spelled, documented and turned into an EngineConfig in one place.

`pagedserve triton` takes only the LoRA flags (add_lora_args), which it writes into the repository
it serves; a Triton model reads its other settings from its engine.json (docs/triton.md).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when used: a command's --help needs no engine module
    from pagedserve.core.config import EngineConfig

ENGINE_FLAGS = ("model", "dtype", "quantization", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "kv_cache_memory", "max_waiting_requests", "max_waiting_prompt_tokens", "request_timeout",
                "max_request_bytes", "drain_timeout", "record_workload", "enable_lora", "max_loras", "max_lora_rank",
                "max_cpu_loras", "lora_modules")
"""EngineConfig keys that have a flag (--max-num-seqs sets max_num_seqs)."""


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add the engine flags (and --engine-config) to a command's parser; every default is None, so
    only what the user gives overrides the file or core/config.py's defaults."""
    p.add_argument("--model", default=None, help='local HF directory, or "default" (embedded SmolLM2-135M)')
    p.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    p.add_argument("--quantization", default=None,
                   help="int8: weight-only int8 linear layers on CPU, made at load (default: unquantized)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (tokens)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache pool")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests queued for admission before new ones are refused (default 256)")
    p.add_argument("--max-waiting-prompt-tokens", type=int, default=None,
                   help="prompt tokens queued for admission before new requests are refused (default 262144)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request ends with finish_reason 'timeout' (default: off)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body / prompt input in bytes (default 8 MiB)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds requests in flight get to finish on SIGTERM (default 20)")
    p.add_argument("--record-workload", default=None, metavar="PATH",
                   help="append each finished request's arrival time and lengths (no text) to PATH, for `tune`")
    add_lora_args(p)
    p.add_argument("--engine-config", default=None, help="JSON file of engine settings (flags override it)")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags; also `pagedserve triton`'s, which writes them into the repository it serves."""
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters chosen per request (docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=None, help="adapters resident at once, in one step (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank served (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory, LRU (default: --max-loras)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='adapters loaded at start: name=path or \'{"name": ..., "path": ...}\' (needs --enable-lora)')


def engine_config_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> EngineConfig:
    """The strict EngineConfig of parsed flags: --engine-config's file (if any) with the flags given
    on top. `defaults`, a command's own (run-batch's throughput policy), fill only the keys neither
    the file nor the flags set. Raises ConfigError naming the key, or OSError for an unreadable file."""
    from pagedserve.core.config import EngineConfig

    flags = {key: getattr(args, key) for key in ENGINE_FLAGS if getattr(args, key, None) is not None}
    if "lora_modules" in flags:
        flags["lora_modules"] = parse_lora_modules(flags["lora_modules"])
    if args.engine_config:
        return EngineConfig.from_json_file(args.engine_config, flags, defaults)
    return EngineConfig.from_dict({**(defaults or {}), **flags})


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """--lora-modules values as vLLM takes them: name=path, or a JSON object {"name": ..., "path": ...}
    (its base_model_name is accepted and ignored: one base model here). Raises ConfigError."""
    import json

    from pagedserve.core.errors import ConfigError

    modules: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--lora-modules {item!r} is not valid JSON ({exc.msg}); use name=path or "
                                  '\'{"name": "NAME", "path": "PATH"}\'', param="lora_modules") from None
            extra = set(spec) - {"name", "path", "base_model_name"} if isinstance(spec, dict) else {"?"}
            if extra or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ConfigError(f"--lora-modules {item!r}: expected {{\"name\": str, \"path\": str}}",
                                  param="lora_modules")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: expected name=path (e.g. sql=/adapters/sql-lora)",
                                  param="lora_modules")
        if name in modules and modules[name] != path:
            raise ConfigError(f"--lora-modules names {name!r} twice ({modules[name]} and {path}); "
                              "give each adapter a unique name", param="lora_modules")
        modules[name] = path
    return modules
