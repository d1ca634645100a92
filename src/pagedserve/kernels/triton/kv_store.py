"""Triton KV store: scatter this step's K/V into the paged cache through slot_mapping,
quantizing on write. Twin of pagedserve.kernels.reference.attention.reshape_and_cache.

One program per new token handles all its KV heads as one [BLOCK_H, BLOCK_D] tile: load K (then
V), take the per-head amax for a dynamic scale, quantize, store the codes and the scale at the
token's slot. Slot offsets are int64 (slot * num_kv_heads * head_dim overflows int32 at ~16M slots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import contract
from pagedserve.kernels.kv_quant import BF16_KEEP_MASK, BF16_ROUND_UP_ADD, MIN_SCALE
from pagedserve.kernels.triton.quant import check_cache_dtype_supported, quant_constexprs, quantize_to_grid

__all__ = ["reshape_and_cache"]

MODES = {"none": 0, "dynamic": 1, "static": 2}
# Triton kernels may only read constexpr globals.
_BF16_ROUND_UP_ADD = tl.constexpr(BF16_ROUND_UP_ADD)
_BF16_KEEP_MASK = tl.constexpr(BF16_KEEP_MASK)


@triton.jit
def _store_one(x, cache_ptr, scale_ptr, slot, h, hmask, offs, mask, num_kv_heads,
               QUANT: tl.constexpr, ROUND: tl.constexpr, MIN_SCALE_C: tl.constexpr, QMAX: tl.constexpr,
               IS_INT8: tl.constexpr,
               FP8_SHIFT: tl.constexpr, FP8_MASK: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
               FP8_SUB_MAGIC: tl.constexpr):
    if QUANT == 0:
        if ROUND:  # fp32 -> fp16/bf16 to nearest-even on every backend (see quantize_to_grid)
            x = quantize_to_grid(x, QMAX, IS_INT8, FP8_SHIFT, FP8_MASK, FP8_MIN_NORMAL, FP8_SUB_MAGIC)
        tl.store(cache_ptr + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        # div_rn: IEEE division as torch does it (plain `/` is div.full.f32 on NVIDIA, off by up
        # to 2 ulp, which would move codes sitting on a rounding boundary).
        if QUANT == 1:
            # Dynamic: one symmetric scale per (token, head); scales are [slots, num_kv_heads].
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), MIN_SCALE_C)
            # Round up to the bf16 grid (kv_quant.round_scale_up's bit arithmetic), so the codes
            # below are computed with exactly the scale that is stored.
            bits = (scale.to(tl.int32, bitcast=True) + _BF16_ROUND_UP_ADD) & _BF16_KEEP_MASK
            scale = bits.to(tl.float32, bitcast=True)
            tl.store(scale_ptr + slot * num_kv_heads + h, scale.to(scale_ptr.dtype.element_ty), mask=hmask)
            xb, sb = tl.broadcast(x, scale[:, None])
        else:
            xb, sb = tl.broadcast(x, tl.full([1, 1], 0.0, tl.float32) + tl.load(scale_ptr))
        y = tl.math.div_rn(xb, sb)
        y = quantize_to_grid(y, QMAX, IS_INT8, FP8_SHIFT, FP8_MASK, FP8_MIN_NORMAL, FP8_SUB_MAGIC)
        tl.store(cache_ptr + offs, y.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_c_slot, stride_c_head, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, ROUND: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_MASK: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_MAGIC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)  # int64
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < num_kv_heads
    mask = hmask[:, None] & (d[None, :] < head_dim)
    offs = slot * stride_c_slot + h[:, None] * stride_c_head + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    _store_one(k.to(tl.float32), key_cache_ptr, k_scale_ptr, slot, h, hmask, offs, mask, num_kv_heads,
               QUANT, ROUND, MIN_SCALE_C, QMAX, IS_INT8, FP8_SHIFT, FP8_MASK, FP8_MIN_NORMAL, FP8_SUB_MAGIC)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    _store_one(v.to(tl.float32), value_cache_ptr, v_scale_ptr, slot, h, hmask, offs, mask, num_kv_heads,
               QUANT, ROUND, MIN_SCALE_C, QMAX, IS_INT8, FP8_SHIFT, FP8_MASK, FP8_MIN_NORMAL, FP8_SUB_MAGIC)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Store K/V at their slots, quantizing on write (same contract as the reference twin).

    key, value:   [num_tokens, num_kv_heads, head_dim], fp32/bf16/fp16, last dim contiguous (the
                  token and head strides are free: q/k/v may be views of one fused projection).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same dtype.
    slot_mapping: int64 [num_tokens], unique slots in range.
    k_scale, v_scale: None (float cache), bf16 [num_blocks, block_size, num_kv_heads] contiguous
                  (dynamic, written here) or fp32 0-dim (static, read).
    """
    mode = contract.check_kv_store_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    # What this kernel's addressing needs beyond the shared contract:
    for name, x in (("key", key), ("value", value)):
        assert x.stride(2) == 1, f"{name} must be contiguous in head_dim, strides {x.stride()}"
        assert x.device == key_cache.device, f"{name} is on {x.device}, the cache on {key_cache.device}"
    assert slot_mapping.is_contiguous() and slot_mapping.device == key_cache.device, (
        "slot_mapping must be contiguous and on the cache's device")
    check_cache_dtype_supported(key_cache.dtype, key_cache.device)
    _, _, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    dummy = key_cache  # unused pointer when there are no scales (QUANT == 0 never reads it)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(1), key_cache.stride(2), num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=MODES[mode], ROUND=key_cache.dtype in (torch.float16, torch.bfloat16) and key.dtype != key_cache.dtype,
        MIN_SCALE_C=MIN_SCALE, **quant_constexprs(key_cache.dtype),
    )
