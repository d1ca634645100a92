"""Pure-torch KV quantization (see pagedserve.kernels.kv_quant for the format)."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.kernels.kv_quant import MIN_SCALE, QUANT_MAX

__all__ = ["quantize_kv", "dequantize_kv"]


def quantize_kv(x: Tensor, cache_dtype: torch.dtype, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [num_tokens, num_kv_heads, head_dim] (any float dtype) -> (codes in cache_dtype, fp32 scale).

    scale None: dynamic, one scale per (token, head) -> returned as [num_tokens, num_kv_heads].
    scale 0-dim: static; returned as given. Codes saturate at +-qmax in both cases.
    """
    qmax = QUANT_MAX[cache_dtype]
    x = x.float()
    if scale is None:
        scale = (x.abs().amax(dim=-1) / qmax).clamp_min_(MIN_SCALE)
        y = x / scale[..., None]
    else:
        y = x / scale
    y = y.clamp_(-qmax, qmax)  # dynamic: only rounding can overshoot; static: outliers saturate
    if cache_dtype == torch.int8:
        return y.round_().to(torch.int8), scale
    return y.to(cache_dtype), scale  # clamped first: fp8_e5m2 would turn an overflow into inf


def dequantize_kv(codes: Tensor, scale: Tensor) -> Tensor:
    """codes [..., head_dim] and scale [...] (per slot) or 0-dim -> fp32 values."""
    assert codes.dtype in QUANT_MAX, f"dequantize_kv takes quantized codes, got {codes.dtype}"
    x = codes.float()  # a new tensor (codes are never fp32), so the in-place scaling below is safe
    return x.mul_(scale) if scale.dim() == 0 else x.mul_(scale[..., None])
