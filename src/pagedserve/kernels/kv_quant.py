"""KV-cache quantization formats shared by the reference and the Triton kernels (no torch ops here).

A quantized cache stores ``code = clamp(round(x / scale), -qmax, qmax)`` in the cache dtype and is
read back as ``code * scale``. Two ways to get ``scale``:

* dynamic (the default): one symmetric scale per token and per KV head, ``amax(|x|) / qmax`` over
  head_dim, computed when the token is written and stored in **bf16**, rounded UP to the bf16 grid
  before the codes are computed (`round_scale_up`). It lives in a tensor ``[num_blocks, block_size,
  num_kv_heads]`` beside the cache: the same blocks' index space, so a block table addresses both.
  No calibration data is needed, and an outlier token only coarsens its own row.
  Why bf16: at head_dim 64 a token-head costs 64 code bytes + the scale, so a 4-byte scale caps the
  gain over a bf16 cache at 128/68 = 1.88x, a 2-byte one gives 128/66 = 1.94x. bf16 keeps fp32's
  exponent range (fp16 would flush the tiny scales of fp8_e5m2, qmax 57344, to subnormals), and
  rounding the scale up costs nothing in accuracy: the codes are computed with the stored scale
  itself, whose 8-bit mantissa only shrinks the used code range by < 0.4% (|x| / scale <= qmax).
* static: a 0-dim fp32 per-tensor scale per layer, given by a checkpoint (vLLM's ``k_scale`` /
  ``v_scale``). Values beyond ``qmax * scale`` saturate at ``+-qmax`` (never inf/NaN).

Rounding is to nearest-even in every format (torch's rounding for ``round`` and fp8 casts).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_dtypes import KV_CACHE_DTYPES

# The dtype sets of kv_dtypes.KV_CACHE_DTYPES, by torch dtype.
QUANT_MAX: dict[torch.dtype, float] = {d.torch_dtype: d.qmax for d in KV_CACHE_DTYPES.values() if d.quantized}
"""Largest code magnitude of each quantized cache dtype."""
FLOAT_CACHE_DTYPES = tuple(d.torch_dtype for d in KV_CACHE_DTYPES.values() if not d.quantized)
FP8_DTYPES = tuple(d.torch_dtype for d in KV_CACHE_DTYPES.values() if d.fp8)
# Floor of a dynamic scale: an all-zero row (amax 0) must not divide by zero.
MIN_SCALE = 1e-12
DYNAMIC_SCALE_DTYPE = torch.bfloat16
STATIC_SCALE_DTYPE = torch.float32
# Adding this to an fp32 bit pattern and clearing the low 16 bits rounds a positive float up to the
# bf16 grid (a value already on it is unchanged). The Triton store uses the same bit arithmetic.
BF16_ROUND_UP_ADD = 0xFFFF
BF16_KEEP_MASK = -65536  # 0xFFFF0000 as a signed int32


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def scale_mode(key_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> str:
    """'none' (float cache), 'dynamic' ([num_blocks, block_size, num_kv_heads] scales) or 'static' (0-dim).

    Asserts that the scales fit the cache: a float cache takes none, a quantized cache needs both.
    """
    if not is_quantized(key_cache.dtype):
        assert key_cache.dtype in FLOAT_CACHE_DTYPES, f"unsupported KV cache dtype {key_cache.dtype}"
        assert k_scale is None and v_scale is None, f"a {key_cache.dtype} KV cache takes no k_scale/v_scale"
        return "none"
    assert k_scale is not None and v_scale is not None, (
        f"a {key_cache.dtype} KV cache needs k_scale and v_scale (per-slot [num_blocks, block_size, "
        "num_kv_heads] or 0-dim static)")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s.device == key_cache.device, f"{name} is on {s.device}, the cache on {key_cache.device}"
    assert k_scale.dim() == v_scale.dim(), "k_scale and v_scale must both be per-slot or both static"
    mode = "static" if k_scale.dim() == 0 else "dynamic"
    want = STATIC_SCALE_DTYPE if mode == "static" else DYNAMIC_SCALE_DTYPE
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s.dtype == want, f"{mode} {name} must be {want}, got {s.dtype}"
    if mode == "static":
        return "static"
    expected = tuple(key_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert tuple(s.shape) == expected and s.is_contiguous(), (
            f"{name} must be contiguous [num_blocks, block_size, num_kv_heads] = {expected}, got {tuple(s.shape)}")
    return "dynamic"
