"""The paged KV cache tensors: spec (dtype, bytes per block including scales), sizing, allocation.

Per layer the cache is ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, num_kv_heads,
head_dim]`` in the storage dtype. With layer groups (core/kv_cache/layout.py: sliding-window layers
beside full-attention ones) layers of different groups share these tensors, each at its own group's
block ids, and they have one row more for the null block. Quantized caches (int8, fp8_e4m3, fp8_e5m2; format in
pagedserve.kernels.kv_quant) add scales:

* dynamic (default): bf16 ``k_scale`` / ``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` per
  layer, one per token and KV head, in the same block index space as the cache. Their bytes count
  in `KVCacheSpec.bytes_per_block`, so the pool is sized with them: head_dim 64 costs 64 + 2 bytes
  per token and head in int8 versus 128 in bf16 (1.94x the tokens) and 256 in fp32 (3.88x).
* static (fp32): a checkpoint's per-tensor ``k_scale`` / ``v_scale`` (vLLM's fp8 layout), 0-dim per layer;
  no per-block bytes. Used for fp8 caches only: the scales are calibrated for the fp8 range.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.core.config import check_kv_cache_dtype
from pagedserve.core.errors import ConfigError
from pagedserve.core.kv_cache.layout import KVCacheLayout, single_group_layout
from pagedserve.kernels.kv_dtypes import KV_CACHE_DTYPES
from pagedserve.kernels.kv_quant import DYNAMIC_SCALE_DTYPE, FP8_DTYPES, STATIC_SCALE_DTYPE, is_quantized

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheTensors:
    """One layer's paged cache. key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    k_scale/v_scale: None (float cache), bf16 [num_blocks, block_size, num_kv_heads] (dynamic) or
    fp32 0-dim (static)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    group: int = 0
    """The layer group (core/kv_cache/layout.py) whose block table indexes these tensors."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """Storage dtype of key_cache / value_cache."""
    static_scales: tuple[tuple[float, float], ...] | None = None
    """Per layer (k_scale, v_scale) from the checkpoint; None: dynamic scales (quantized caches)."""
    layers_per_block: int | None = None
    """Layers whose K/V one pool block holds: None, every layer; a group's size when layer groups
    share cache tensors (core/kv_cache/layout.py)."""

    def __post_init__(self) -> None:
        if self.static_scales is not None:
            assert is_quantized(self.dtype), "static KV scales need a quantized cache dtype"
            assert len(self.static_scales) == self.num_layers, "one (k_scale, v_scale) per layer"

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def dynamic_scales(self) -> bool:
        return self.quantized and self.static_scales is None

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across the layers it holds, scales included."""
        slots = self.block_size * self.num_kv_heads
        per_tensor = slots * self.head_dim * self.dtype.itemsize
        if self.dynamic_scales:
            per_tensor += slots * DYNAMIC_SCALE_DTYPE.itemsize
        return (self.layers_per_block or self.num_layers) * 2 * per_tensor

    def num_blocks(self, budget_bytes: int) -> int:
        """Whole blocks (scales included) that fit budget_bytes."""
        return budget_bytes // self.bytes_per_block


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """kv_cache_dtype from the config -> storage dtype ("auto": the model dtype)."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name].torch_dtype


def make_kv_cache_spec(kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int, block_size: int,
                       num_kv_heads: int, head_dim: int, model_path: Path | None = None,
                       layers_per_block: int | None = None) -> KVCacheSpec:
    """The engine's spec: static scales come from the checkpoint for fp8 caches when it has them."""
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
    static = load_static_kv_scales(model_path, num_layers) if dtype in FP8_DTYPES and model_path is not None else None
    if static is not None:
        logger.info("KV cache %s: using the checkpoint's static per-tensor k/v scales", kv_cache_dtype)
    return KVCacheSpec(num_layers, block_size, num_kv_heads, head_dim, dtype, static, layers_per_block)


def load_static_kv_scales(model_path: Path, num_layers: int) -> tuple[tuple[float, float], ...] | None:
    """Per-layer (k_scale, v_scale) from ``model.layers.{i}.self_attn.{k,v}_scale`` (or the older
    shared ``kv_scale``) in the checkpoint's safetensors; None unless every layer has them."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")):
                    found[name] = sf.get_tensor(name)
    if not found:
        return None
    scales = []
    for i in range(num_layers):
        p = f"model.layers.{i}.self_attn."
        k, v = found.get(p + "k_scale", found.get(p + "kv_scale")), found.get(p + "v_scale", found.get(p + "kv_scale"))
        if k is None or v is None:
            raise ConfigError(f"{model_path}: checkpoint has KV scales for some layers but not layer {i}")
        k, v = float(k.float().reshape(-1)[0]), float(v.float().reshape(-1)[0])
        if not (k > 0 and v > 0):
            raise ConfigError(f"{model_path}: layer {i} KV scales must be positive, got k={k}, v={v}")
        scales.append((k, v))
    return tuple(scales)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On CPU it lives in its own private anonymous mapping: the kernel hands out
    zero pages on first write, so a KV pool costs resident memory only for the blocks requests
    have used (torch.zeros would write, and so commit, every page of it up front)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `buffer` alive


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       layout: KVCacheLayout | None = None) -> list[KVCacheTensors]:
    """Zeroed caches (and scales) for every layer; on CPU untouched until blocks are used.

    layout: layer groups sharing cache tensors; the j-th layer of each group gets tensor j, and the
    tensors have one row past the pool for the null block when a group frees blocks. None: one
    tensor per layer (one group)."""
    if layout is None:
        layout = single_group_layout(spec.num_layers)
    assert layout.num_layers == spec.num_layers, f"layout has {layout.num_layers} layers, spec {spec.num_layers}"
    assert (spec.layers_per_block or spec.num_layers) == layout.layers_per_block, (
        "spec and layout disagree on layers per block")
    rows = num_blocks + (1 if layout.frees_blocks else 0)
    shape = (rows, spec.block_size, spec.num_kv_heads, spec.head_dim)
    shared = []
    for _ in range(layout.layers_per_block):
        scales = (None, None)
        if spec.dynamic_scales:
            scales = tuple(lazy_zeros(shape[:3], DYNAMIC_SCALE_DTYPE, device) for _ in range(2))
        shared.append((lazy_zeros(shape, spec.dtype, device), lazy_zeros(shape, spec.dtype, device), *scales))
    caches = []
    for layer, (group, j) in enumerate(layout.group_and_tensor_of_layers()):
        key, value, k_scale, v_scale = shared[j]
        if spec.static_scales is not None:
            k, v = spec.static_scales[layer]
            k_scale = torch.tensor(k, dtype=STATIC_SCALE_DTYPE, device=device)
            v_scale = torch.tensor(v, dtype=STATIC_SCALE_DTYPE, device=device)
        caches.append(KVCacheTensors(key, value, k_scale, v_scale, group))
    return caches
