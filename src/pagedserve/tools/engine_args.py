"""The engine's command-line flags, shared by every command that starts an engine (`pagedserve
generate`, `pagedserve kserve`, `pagedserve run-batch`, `pagedserve tune`), so each flag is
spelled, documented and turned into an EngineConfig in one place.

`pagedserve triton` takes no engine flags: a Triton model reads its engine.json (docs/triton.md).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when used: a command's --help needs no engine module
    from pagedserve.core.config import EngineConfig

ENGINE_FLAGS = ("model", "dtype", "quantization", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "kv_cache_memory", "max_waiting_requests", "max_waiting_prompt_tokens", "request_timeout",
                "max_request_bytes", "drain_timeout", "record_workload")
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
    p.add_argument("--engine-config", default=None, help="JSON file of engine settings (flags override it)")


def engine_config_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> EngineConfig:
    """The strict EngineConfig of parsed flags: --engine-config's file (if any) with the flags given
    on top. `defaults`, a command's own (run-batch's throughput policy), fill only the keys neither
    the file nor the flags set. Raises ConfigError naming the key, or OSError for an unreadable file."""
    from pagedserve.core.config import EngineConfig

    flags = {key: getattr(args, key) for key in ENGINE_FLAGS if getattr(args, key) is not None}
    if args.engine_config:
        return EngineConfig.from_json_file(args.engine_config, flags, defaults)
    return EngineConfig.from_dict({**(defaults or {}), **flags})
