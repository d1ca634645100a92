"""Paged batches in any KV cache dtype, for the quantized reference and the Triton tests.

Built on test_reference_attention.make_batch (random K/V scattered into random blocks of a pool,
stale block-table entries, unused slots poisoned). For a quantized cache the poison is NaN fp8
codes, or NaN per-slot scales for int8 (its codes cannot be NaN): any read of a slot that holds
no token of the sequence turns the output into NaN.
"""

from __future__ import annotations

import math

import torch

from pagedserve.kernels.kv_quant import QUANT_MAX, is_quantized
from pagedserve.kernels.reference.quant import dequantize_kv, quantize_kv

from tests.kernels.test_reference_attention import make_batch

FLOAT_KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
QUANT_KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def static_scales(keys, values, cache_dtype):
    """Per-tensor scales that just cover the data (what a calibration would give)."""
    qmax = QUANT_MAX[cache_dtype]
    return (torch.tensor(max(k.abs().max().item() for k in keys if k.numel()) / qmax),
            torch.tensor(max(v.abs().max().item() for v in values if v.numel()) / qmax))


def quantize_cache(cache: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None):
    """fp32 cache (NaN in unused slots) -> (codes cache, per-slot scales [nb, bs, H] or the static scale)."""
    nb, bs, h, d = cache.shape
    flat = cache.view(-1, h, d)
    used = ~flat.isnan().any(-1).any(-1)
    codes, s = quantize_kv(flat[used], cache_dtype, scale)
    out = torch.full((nb * bs, h, d), math.nan).to(cache_dtype) if cache_dtype != torch.int8 else (
        torch.zeros((nb * bs, h, d), dtype=torch.int8))
    out.view(torch.uint8)[used] = codes.view(torch.uint8)
    if scale is not None:
        return out.view(nb, bs, h, d), scale
    scales = torch.full((nb * bs, h), math.nan, dtype=s.dtype)
    scales[used] = s
    return out.view(nb, bs, h, d), scales.view(nb, bs, h)


def make_kv_batch(specs, *, cache_dtype, num_kv_heads, group, head_dim, block_size,
                  query_dtype=torch.float32, static=False, seed=0):
    """(kernel kwargs, (keys, values, queries) as the kernels see them: dequantized if quantized)."""
    args, (keys, values, queries) = make_batch(
        specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, seed=seed)
    args["query"] = args["query"].to(query_dtype)
    queries = [q.to(query_dtype) for q in queries]
    if not is_quantized(cache_dtype):
        args["key_cache"] = args["key_cache"].to(cache_dtype)
        args["value_cache"] = args["value_cache"].to(cache_dtype)
        return args, ([k.to(cache_dtype) for k in keys], [v.to(cache_dtype) for v in values], queries)
    ks, vs = static_scales(keys, values, cache_dtype) if static else (None, None)
    args["key_cache"], args["k_scale"] = quantize_cache(args["key_cache"], cache_dtype, ks)
    args["value_cache"], args["v_scale"] = quantize_cache(args["value_cache"], cache_dtype, vs)
    keys = [dequantize_kv(*quantize_kv(k, cache_dtype, ks)) for k in keys]
    values = [dequantize_kv(*quantize_kv(v, cache_dtype, vs)) for v in values]
    return args, (keys, values, queries)
