"""Triton helpers for the KV quantization format of pagedserve.kernels.kv_quant (arithmetic only).

Both the store kernel (quantize on write) and its tests use these; the constants they need come
from `quant_constexprs`, computed on the host once per cache dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels.kv_quant import QUANT_MAX

# Reduced-precision float formats: (mantissa bits, exponent of the smallest normal number).
_FLOAT_LAYOUT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14),
                 torch.float16: (10, -14), torch.bfloat16: (7, -126)}


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def check_cache_dtype_supported(dtype: torch.dtype, device: torch.device) -> None:
    """Triton converts fp8 e4m3 ("fp8e4nv") only on sm_89+ (Ada, Hopper and later)."""
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        assert _capability(device) >= (8, 9), (
            f"kv_cache_dtype fp8_e4m3 needs an sm_89+ GPU for the Triton kernels, this one is "
            f"sm_{''.join(map(str, _capability(device)))}; use int8 or attention_backend='reference'")


def quant_constexprs(cache_dtype: torch.dtype) -> dict[str, object]:
    """Keyword constexprs of `quantize_to_grid` for a cache dtype.

    QMAX saturates (int8/fp8: the format's code range; fp16/bf16: their finite max). fp32 caches
    never call `quantize_to_grid`; they get harmless placeholders.
    """
    if cache_dtype == torch.int8:
        return dict(QMAX=QUANT_MAX[cache_dtype], IS_INT8=True, FP8_SHIFT=1, FP8_MASK=0,
                    FP8_MIN_NORMAL=1.0, FP8_SUB_MAGIC=1.0)
    if cache_dtype in _FLOAT_LAYOUT:
        mant, emin = _FLOAT_LAYOUT[cache_dtype]
        shift = 23 - mant  # fp32 mantissa bits dropped
        qmax = QUANT_MAX.get(cache_dtype, torch.finfo(cache_dtype).max)
        return dict(QMAX=qmax, IS_INT8=False, FP8_SHIFT=shift, FP8_MASK=-(1 << shift),
                    FP8_MIN_NORMAL=2.0**emin,
                    # fp32 ulp of this number == the format's subnormal step 2^(emin - mant)
                    FP8_SUB_MAGIC=2.0 ** (emin - mant + 23))
    return dict(QMAX=1.0, IS_INT8=False, FP8_SHIFT=1, FP8_MASK=0, FP8_MIN_NORMAL=1.0, FP8_SUB_MAGIC=1.0)


@triton.jit
def quantize_to_grid(y, QMAX: tl.constexpr, IS_INT8: tl.constexpr, FP8_SHIFT: tl.constexpr,
                     FP8_MASK: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_MAGIC: tl.constexpr):
    """fp32 y (= x / scale) -> fp32 values that the cache dtype represents exactly, saturated at +-QMAX.

    Rounding is done here, to nearest-even as torch does, so the final cast to the cache dtype is
    exact on every backend: hardware cvt, or the interpreter, whose own fp32->fp8 rounding loses
    the mantissa carry in triton 3.9 (31.9 -> 16) and whose fp32->bf16 cast truncates. The "FP8"
    parameters describe any reduced float format (fp16/bf16 too, for a 16-bit cache).
    """
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT8:
        # 1.5 * 2^23: adding and subtracting it rounds |y| < 2^22 to an integer, ties to even
        # (IEEE round-to-nearest adds; Triton uses no fast-math, so the pair is not folded away).
        r = (y + 12582912.0) - 12582912.0
    else:
        a = tl.abs(y)
        # Normal range: round the fp32 mantissa to the fp8 width on the bit pattern; the carry runs
        # into the exponent, as it should. |y| <= QMAX keeps the exponent finite.
        bits = a.to(tl.int32, bitcast=True)
        half = (1 << (FP8_SHIFT - 1)) - 1
        bits = (bits + half + ((bits >> FP8_SHIFT) & 1)) & FP8_MASK
        normal = bits.to(tl.float32, bitcast=True)
        # Subnormal range: a fixed step, rounded by an fp32 add whose ulp is that step.
        sub = (a + FP8_SUB_MAGIC) - FP8_SUB_MAGIC
        r = tl.where(a < FP8_MIN_NORMAL, sub, normal)
        r = tl.where(y < 0, -r, r)
    return r
