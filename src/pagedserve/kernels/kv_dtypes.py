"""The KV-cache dtypes in one table: the names `kv_cache_dtype` accepts, the torch dtype each one
stores in, whether it is quantized (and its largest code) and whether it is an fp8 format.

Read by the engine config (the names), the cache allocation (the storage dtype) and the kernels
(pagedserve.kernels.kv_quant derives its dtype sets from here). This module does not import torch
until a storage dtype is asked for, so validating a config does not load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVCacheDtype:
    name: str
    """As `kv_cache_dtype` spells it."""
    storage: str
    """The torch dtype the cache is stored in, by its name in torch."""
    qmax: float | None = None
    """Quantized formats: the largest code magnitude (int8 is symmetric and never writes -128; fp8
    formats use their finite maxima). None: a float cache, stored as is."""
    fp8: bool = False

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.storage)


KV_CACHE_DTYPES: dict[str, KVCacheDtype] = {d.name: d for d in (
    KVCacheDtype("fp32", "float32"),
    KVCacheDtype("bf16", "bfloat16"),
    KVCacheDtype("fp16", "float16"),
    KVCacheDtype("int8", "int8", qmax=127.0),
    KVCacheDtype("fp8_e4m3", "float8_e4m3fn", qmax=448.0, fp8=True),
    KVCacheDtype("fp8_e5m2", "float8_e5m2", qmax=57344.0, fp8=True),
)}
KV_CACHE_DTYPE_NAMES = ("auto", *KV_CACHE_DTYPES)
"""Every value kv_cache_dtype accepts; "auto" stores the cache in the model's dtype."""
