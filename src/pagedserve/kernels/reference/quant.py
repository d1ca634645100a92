"""Pure-torch KV quantization (see pagedserve.kernels.kv_quant for the format)."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.kernels.kv_quant import (BF16_KEEP_MASK, BF16_ROUND_UP_ADD, DYNAMIC_SCALE_DTYPE, MIN_SCALE,
                                         QUANT_MAX)

__all__ = ["quantize_kv", "dequantize_kv", "round_scale_up"]


def round_scale_up(scale: Tensor) -> Tensor:
    """Positive fp32 scales -> the smallest bf16-representable values >= them (still fp32)."""
    bits = scale.contiguous().view(torch.int32)
    return ((bits + BF16_ROUND_UP_ADD) & BF16_KEEP_MASK).view(torch.float32)


def quantize_kv(x: Tensor, cache_dtype: torch.dtype, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [num_tokens, num_kv_heads, head_dim] (any float dtype) -> (codes in cache_dtype, scale).

    scale None: dynamic, one scale per (token, head), rounded up to bf16 before the division ->
    returned as bf16 [num_tokens, num_kv_heads]. scale 0-dim (fp32): static; returned as given.
    Codes saturate at +-qmax in both cases.
    """
    qmax = QUANT_MAX[cache_dtype]
    x = x.float()
    if scale is None:
        scale = round_scale_up((x.abs().amax(dim=-1) / qmax).clamp_min_(MIN_SCALE))
        y = x / scale[..., None]
        scale = scale.to(DYNAMIC_SCALE_DTYPE)  # exact: the value is on the bf16 grid
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
    return x.mul_(scale) if scale.dim() == 0 else x.mul_(scale.float()[..., None])
