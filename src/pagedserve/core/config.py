"""Engine configuration: EngineConfig = ModelConfig + CacheConfig + SchedulerConfig + LimitsConfig
+ LoRAConfig.

Defaults live here and nowhere else. `EngineConfig.from_dict` takes one flat dict (the shape of a
Triton model.json or CLI flags), rejects unknown keys and names the field, value and fix on error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.core.errors import ConfigError
from pagedserve.core.validation import build_strict, check_range, parse_json
from pagedserve.kernels.kv_dtypes import KV_CACHE_DTYPE_NAMES

DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
ATTENTION_BACKENDS = ("auto", "cpu", "reference", "triton")
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
SCHEDULING_POLICIES = ("fcfs", "prefix", "throughput")


def check_kv_cache_dtype(name: str) -> None:
    """kv_cache_dtype names one of pagedserve.kernels.kv_dtypes.KV_CACHE_DTYPES, or "auto"."""
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ConfigError(f"kv_cache_dtype={name!r} is not supported; use one of {KV_CACHE_DTYPE_NAMES}")


@dataclass(frozen=True)
class ModelConfig:
    model: str = "default"
    """A local Hugging Face directory, or "default" for the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Weights and activations: auto (bf16 on GPU and on CPUs with AMX/AVX512-BF16, else fp32)."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda or cuda:N."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's max_position_embeddings."""
    attention_backend: str = "auto"
    """auto (triton kernels on CUDA; on CPU the C++ kernels, or reference if they cannot be built),
    cpu (C++ kernels, an error if they cannot be built), reference (pure torch), triton."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model: must name a local model directory or 'default'")
        if self.dtype not in DTYPE_ALIASES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use one of {sorted(DTYPE_ALIASES)}")
        object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} is not supported; use one of {ATTENTION_BACKENDS}"
            )
        check_range(ConfigError, "max_model_len", self.max_model_len, 1)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_dtype: str = "auto"
    """auto (the model dtype), fp32, bf16, fp16, int8, fp8_e4m3, fp8_e5m2."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool. Default on CPU: what max_num_seqs sequences of max_model_len tokens
    can use, at most 2 GiB (resident only as blocks get used); on GPU, gpu_memory_utilization decides."""
    gpu_memory_utilization: float = 0.9
    """Fraction of free device memory (after loading weights) given to the KV pool on GPU."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides the memory budget (tests, reproducible benchmarks)."""
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    """True: every layer keeps the KV of the whole sequence, as before layer groups. False (default):
    sliding-window layers (Gemma 2/3, Mistral, Phi-3) return blocks older than their window to the
    pool, so more sequences fit (core/kv_cache/layout.py; vLLM's flag of the same name)."""

    def __post_init__(self) -> None:
        check_range(ConfigError, "block_size", self.block_size, 1, 1024)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_range(ConfigError, "kv_cache_memory", self.kv_cache_memory, 1)
        check_range(ConfigError, "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_range(ConfigError, "num_kv_blocks", self.num_kv_blocks, 1)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests running in one iteration."""
    max_num_batched_tokens: int = 1024
    """Token budget of one iteration: decodes (1 token each) plus prefill chunks."""
    long_prefill_token_threshold: int | None = None
    """Cap on one request's prefill chunk per step (None: only the token budget limits it)."""
    scheduling_policy: str = "fcfs"
    """Order of admission: fcfs (arrival order; online serving), prefix (requests sharing a cached or
    pending prefix run together), throughput (prefix grouping + long decodes first + admission by
    projected KV memory; offline batch jobs). See docs/batch_and_tuning.md."""
    scheduling_age_bound_s: float = 60.0
    """prefix/throughput: a request waiting longer than this goes first, in arrival order (no
    starvation). fcfs ignores it."""
    record_workload: str | None = None
    """Opt-in: append each finished request's arrival time and prompt/output lengths (never text)
    to this JSONL file, the workload format `pagedserve tune` replays."""

    def __post_init__(self) -> None:
        check_range(ConfigError, "max_num_seqs", self.max_num_seqs, 1)
        check_range(ConfigError, "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_range(ConfigError, "long_prefill_token_threshold", self.long_prefill_token_threshold, 1)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy={self.scheduling_policy!r} is not supported; "
                              f"use one of {SCHEDULING_POLICIES}")
        check_range(ConfigError, "scheduling_age_bound_s", self.scheduling_age_bound_s, 0.0, low_open=True)


DEFAULT_MAX_REQUEST_BYTES = 8 * 1024**2


@dataclass(frozen=True)
class LimitsConfig:
    """What one request, or a crowd of them, may ask of a server (docs/triton.md, docs/kserve.md).
    The engine applies the queue bounds and timeouts; the adapters apply the size and drain limits."""

    max_waiting_requests: int | None = 256
    """Requests (each of n samples counts) waiting for a slot in the running batch (max_num_seqs).
    A request arriving at a full queue is refused at once (KServe 429 with Retry-After, Triton
    UNAVAILABLE). None: unbounded."""
    max_waiting_prompt_tokens: int | None = 262144
    """Tokens of the queued requests' prompts, same refusal. A request arriving at an empty queue
    is always admitted, however long. None: unbounded."""
    request_timeout: float | None = None
    """Seconds from arrival after which a request still running ends with finish_reason "timeout"
    (its blocks freed). Applies to requests that set no timeout of their own. None: off."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body the KServe server reads (larger: HTTP 413) and largest prompt input a
    Triton model accepts (larger: INVALID_ARG)."""
    drain_timeout: float = 20.0
    """Seconds in-flight requests get to finish after SIGTERM (KServe) or the start of an unload
    (Triton) before they are ended with an error. Below Kubernetes' default 30 s grace period."""

    def __post_init__(self) -> None:
        for name in ("request_timeout", "drain_timeout"):
            value = getattr(self, name)
            if value is not None and value != value:  # NaN passes every range comparison
                raise ConfigError(f"{name}={value!r} is not a number of seconds")
        check_range(ConfigError, "max_waiting_requests", self.max_waiting_requests, 1)
        check_range(ConfigError, "max_waiting_prompt_tokens", self.max_waiting_prompt_tokens, 1)
        check_range(ConfigError, "request_timeout", self.request_timeout, 0.0, low_open=True,
                    hint="use null to turn the default timeout off")
        check_range(ConfigError, "max_request_bytes", self.max_request_bytes, 1024,
                    hint="allow at least 1024 bytes")
        check_range(ConfigError, "drain_timeout", self.drain_timeout, 0.0, 3600.0)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md), vLLM's settings by vLLM's names. In a JSON config either
    flat keys or one object under "lora" ({"lora": {"enable_lora": true, ...}})."""

    enable_lora: bool = False
    max_loras: int = 1
    """Adapters resident in the stacked device weights at once: the most distinct adapters one step
    runs (a request whose adapter finds no free slot waits)."""
    max_lora_rank: int = 16
    """Largest adapter rank served; the stacked weights are this wide."""
    max_cpu_loras: int | None = None
    """Adapters whose weights stay in host memory (LRU; the rest reload from their directory when a
    request needs them). None: max_loras."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """name -> PEFT directory, loaded at start (needs enable_lora)."""

    def __post_init__(self) -> None:
        check_range(ConfigError, "max_loras", self.max_loras, 1, 1024)
        check_range(ConfigError, "max_lora_rank", self.max_lora_rank, 1, 512)
        check_range(ConfigError, "max_cpu_loras", self.max_cpu_loras, self.max_loras,
                    hint=f"keep at least max_loras={self.max_loras} adapters in host memory")
        for name, path in self.lora_modules.items():
            if not name or not path:
                raise ConfigError(f"lora_modules: {name!r} -> {path!r}: give each adapter a non-empty name and "
                                  "PEFT directory (name=path)", param="lora_modules")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError(f"lora_modules names {len(self.lora_modules)} adapter(s) but LoRA is off; add "
                              "--enable-lora (enable_lora: true) to serve them", param="lora_modules")


_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "limits": LimitsConfig,
             "lora": LoRAConfig}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def known_keys(cls) -> dict[str, str]:
        """Flat key -> section name."""
        return {f.name: sec for sec, sub in _SECTIONS.items() for f in dataclasses.fields(sub)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], what: str = "engine config") -> "EngineConfig":
        """Build from one flat dict, e.g. {"model": "default", "block_size": 16, "max_num_seqs": 64}."""
        if not isinstance(data, dict):
            raise ConfigError(f"{what}: expected a JSON object, got {type(data).__name__}")
        data = _flatten_lora_section(data, what)
        keys = cls.known_keys()
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise ConfigError(
                f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(sorted(keys))}"
            )
        parts = {sec: {k: v for k, v in data.items() if keys[k] == sec} for sec in _SECTIONS}
        return cls(**{sec: build_strict(_SECTIONS[sec], parts[sec], ConfigError, what) for sec in _SECTIONS})

    @classmethod
    def from_json_file(cls, path: str | Path, overrides: dict[str, Any] | None = None,
                       defaults: dict[str, Any] | None = None) -> "EngineConfig":
        """Build from a JSON file of flat settings (a Triton engine.json, `--engine-config`);
        `overrides` (e.g. command-line flags) replace its keys, `defaults` fill keys it lacks
        (before core/config.py's own). Every error names the file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: engine config file not found; put the engine settings "
                              '(e.g. {"model": "default"}) in a JSON file') from None
        data = parse_json(text, ConfigError, str(path), 'it holds one object of settings such as {"model": "default"}')
        if isinstance(data, dict):
            data = {**(defaults or {}), **data, **(overrides or {})}
        try:
            return cls.from_dict(data, what=str(path))
        except ConfigError as exc:
            if str(path) in str(exc):
                raise
            # Range checks inside the config sections name the key but not the file: add it.
            raise ConfigError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for sec in _SECTIONS for k, v in dataclasses.asdict(getattr(self, sec)).items()}

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with some flat keys changed (validated like from_dict)."""
        return EngineConfig.from_dict({**self.to_dict(), **changes})


def _flatten_lora_section(data: dict[str, Any], what: str) -> dict[str, Any]:
    """{"lora": {...LoRAConfig fields}} as flat keys (the file form docs/lora.md shows)."""
    if "lora" not in data:
        return data
    section = data["lora"]
    if not isinstance(section, dict):
        raise ConfigError(f"{what}: lora: expected an object of LoRA settings such as "
                          f'{{"enable_lora": true, "max_loras": 4}}, got {section!r}', param="lora")
    fields = {f.name for f in dataclasses.fields(LoRAConfig)}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ConfigError(f"{what}: lora: unknown key(s) {', '.join(map(repr, unknown))}; known keys: "
                          f"{', '.join(sorted(fields))}", param=unknown[0])
    both = sorted(set(section) & set(data))
    if both:
        raise ConfigError(f"{what}: {', '.join(both)} given both flat and under lora; give each once", param=both[0])
    return {**{k: v for k, v in data.items() if k != "lora"}, **section}
