"""LLMEngine: add_request / abort_request / step, and an offline generate()."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedserve.core.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagedserve.core.errors import ConfigError, DuplicateRequest, InvalidRequest, RequestTooLong
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.layers.attention import select_attention_backend
from pagedserve.core.model_runner import ModelRunner, kv_cache_bytes_per_block
from pagedserve.core.models.arch import ModelArch
from pagedserve.core.models.default_model import resolve_model_path
from pagedserve.core.models.loader import load_decoder
from pagedserve.core.outputs import CompletionResult, RequestOutput
from pagedserve.core.request import Request
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.core.scheduler import Scheduler, SchedulerStats

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls beat fp32 there; on plain AVX2 they are ~5x slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA device is available; use device='cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    return _TORCH_DTYPES[name]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer  # heavy import, only when an engine starts

        self.config = config = config or EngineConfig()
        mc, cc = config.model, config.cache
        self.model_path = resolve_model_path(mc.model)
        torch.manual_seed(mc.seed)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.arch = ModelArch.from_hf_config(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self.max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings and self.arch.rope_scaling is None:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.arch.max_position_embeddings}; lower max_model_len"
            )
        self.eos_token_id = self.arch.eos_token_ids[0] if self.arch.eos_token_ids else self.tokenizer.eos_token_id
        attention = select_attention_backend(mc.attention_backend, self.device)
        model = load_decoder(self.model_path, self.arch, self.dtype, self.device, self.max_model_len, attention)
        kv_dtype = self.dtype if cc.kv_cache_dtype == "auto" else _KV_DTYPES.get(cc.kv_cache_dtype)
        if kv_dtype is None:
            raise ConfigError(f"kv_cache_dtype={cc.kv_cache_dtype!r} is not available yet; use auto, fp32, bf16 or fp16")
        self.num_kv_blocks = self._num_kv_blocks(kv_dtype)
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len)
        self.runner = ModelRunner(model, self.num_kv_blocks, cc.block_size, kv_dtype)
        self._ids = itertools.count()
        logger.info("pagedserve engine: %s on %s in %s, %d KV blocks of %d tokens",
                    self.model_path, self.device, self.dtype, self.num_kv_blocks, cc.block_size)

    def _num_kv_blocks(self, kv_dtype: torch.dtype) -> int:
        cc, a = self.config.cache, self.arch
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = kv_cache_bytes_per_block(a.num_layers, cc.block_size, a.num_kv_heads, a.head_dim, kv_dtype)
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * cc.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory={budget} bytes holds no KV block ({per_block} bytes each); raise kv_cache_memory"
            )
        return num_blocks

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequest(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        vocab = self.arch.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest(f"prompt token ids: item {i} is {t!r}; token ids must be integers in [0, {vocab})")
        return ids

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    use_prefix_cache: bool = True) -> str:
        """Queue a request; returns its request_id. Raises InvalidRequest / RequestTooLong."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise DuplicateRequest(f"request_id={request_id!r} is already running; use a unique id")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequest("prompt is empty; send at least one token")
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise RequestTooLong(f"prompt has {n} tokens but max_model_len is {limit}; shorten the prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise RequestTooLong(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds max_model_len={limit}; "
                f"lower max_tokens to at most {limit - n}"
            )
        if not self.kv_cache_manager.can_fit(n + max_tokens):
            cap = self.num_kv_blocks * self.config.cache.block_size
            raise RequestTooLong(
                f"prompt + max_tokens = {n + max_tokens} tokens exceeds the whole KV cache ({cap} tokens); "
                "lower max_tokens or raise kv_cache_memory"
            )
        self.scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            eos_token_id=self.eos_token_id, max_tokens=max_tokens,
            cache_salt=cache_salt, use_prefix_cache=use_prefix_cache,
        ))
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish the request now (finish_reason "abort") and free its blocks; None if unknown."""
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the batch, sample, apply stop rules."""
        sched_out = self.scheduler.schedule()
        sampled = self.runner.execute(sched_out)
        return self.scheduler.update_from_output(sched_out, sampled)

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    # -- offline ---------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, **request_kwargs: Any) -> list[CompletionResult]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.add_request(None, p, sp, **request_kwargs) for p, sp in zip(prompts, params)]
        prompt_ids = {i: tuple(self.scheduler.requests[i].prompt_token_ids) for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str | None] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        start = time.perf_counter()
        while self.has_unfinished_requests():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        logger.debug("generate: %d requests in %.2fs", len(ids), time.perf_counter() - start)
        return [
            CompletionResult(i, prompt_ids[i], tuple(tokens[i]),
                             self.tokenizer.decode(tokens[i], skip_special_tokens=True), reasons.get(i))
            for i in ids
        ]
