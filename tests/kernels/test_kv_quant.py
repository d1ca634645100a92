"""KV-cache quantization in the pure-torch reference: round-trip error bounds, saturation, the
store's slot writes, and quantized paged attention against a dense oracle on the dequantized K/V."""

from __future__ import annotations

import math

import pytest
import torch

import pagedserve.kernels.reference.attention as ref_attn
from pagedserve.kernels.kv_quant import MIN_SCALE, QUANT_MAX
from pagedserve.kernels.reference import paged_attention, reshape_and_cache
from pagedserve.kernels.reference.quant import dequantize_kv, quantize_kv

from tests.kernels.quant_batches import QUANT_KV_DTYPES, make_kv_batch
from tests.kernels.test_reference_attention import MIXED, TOLERANCES, dense_attention

IDS = [str(d).removeprefix("torch.") for d in QUANT_KV_DTYPES]
# Round-trip bounds per element, in units of the row's scale: |x - deq| <= max(REL * |x|, ABS * scale).
# int8: half a code. fp8: half an ulp of the mantissa (e4m3: 3 bits -> 2^-4, e5m2: 2 bits -> 2^-3)
# relative, and half the subnormal step (2^-10, 2^-17) absolute near zero.
ROUND_TRIP = {
    torch.int8: dict(rel=0.0, abs=0.5),
    torch.float8_e4m3fn: dict(rel=2.0**-4, abs=2.0**-10),
    torch.float8_e5m2: dict(rel=2.0**-3, abs=2.0**-17),
}
# Root-mean-square error of Gaussian rows (head_dim 64), relative to the rows' RMS: measured
# 0.0059 / 0.0251 / 0.0497 (int8 / e4m3 / e5m2); the bounds leave 20% room.
RMS_BOUND = {torch.int8: 0.007, torch.float8_e4m3fn: 0.03, torch.float8_e5m2: 0.06}


@pytest.mark.parametrize("dtype", QUANT_KV_DTYPES, ids=IDS)
def test_dynamic_round_trip_error(dtype):
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes: per-(token, head) scales adapt to each.
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-4, 3, 64)[:, None, None]
    codes, scale = quantize_kv(x, dtype)
    assert codes.dtype == dtype and scale.shape == (64, 3) and scale.dtype == torch.bfloat16
    # The bf16 scale is amax / qmax rounded UP to the bf16 grid (8-bit mantissa: < 2^-7 above).
    exact = x.abs().amax(-1) / QUANT_MAX[dtype]
    assert (scale.float() >= exact).all() and (scale.float() <= exact * (1 + 2.0**-7)).all()
    deq = dequantize_kv(codes, scale)
    err = (deq - x).abs()
    b = ROUND_TRIP[dtype]
    bound = torch.maximum(b["rel"] * x.abs(), b["abs"] * scale[..., None]) * (1 + 1e-5) + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # Rounding the scale up never saturates, and the largest code still uses the whole range.
    top = codes.float().abs().amax(-1)
    assert (top <= QUANT_MAX[dtype]).all() and (top >= QUANT_MAX[dtype] * (1 - 2.0**-7) - 0.5).all()
    rms = (err.pow(2).mean((-1)) / x.pow(2).mean(-1)).sqrt().mean().item()
    assert rms <= RMS_BOUND[dtype], f"relative RMS error {rms:.4f} > {RMS_BOUND[dtype]}"


@pytest.mark.parametrize("dtype", QUANT_KV_DTYPES, ids=IDS)
def test_static_scale_saturates_outliers(dtype):
    """A per-tensor scale cannot cover an outlier: it clamps to +-qmax (finite), never inf/NaN."""
    qmax = QUANT_MAX[dtype]
    scale = torch.tensor(0.01)
    x = torch.tensor([[[0.5, -0.25, 1e6, -1e6, math.inf, -math.inf, qmax * 0.01, 0.0]]])
    codes, s = quantize_kv(x, dtype, scale)
    assert s is scale
    deq = dequantize_kv(codes, scale)
    assert torch.isfinite(deq).all()
    expected = torch.tensor([0.5, -0.25, qmax * 0.01, -qmax * 0.01, qmax * 0.01, -qmax * 0.01, qmax * 0.01, 0.0])
    torch.testing.assert_close(deq[0, 0], expected, atol=0, rtol=2.0**-4)


@pytest.mark.parametrize("dtype", QUANT_KV_DTYPES, ids=IDS)
def test_dynamic_outlier_stays_in_its_row(dtype):
    """One huge value coarsens only its own (token, head) row; every other row is unchanged."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, 64, generator=gen)
    spiked = x.clone()
    spiked[3, 1, 10] = 1e4
    clean, _ = quantize_kv(x, dtype)
    codes, scale = quantize_kv(spiked, dtype)
    mask = torch.ones(8, 2, dtype=torch.bool)
    mask[3, 1] = False
    assert torch.equal(codes.view(torch.uint8)[mask], clean.view(torch.uint8)[mask])
    deq = dequantize_kv(codes, scale)
    # The outlier itself is within the round-trip bound of its row (half a code for int8).
    b = ROUND_TRIP[dtype]
    bound = max(b["rel"] * 1e4, b["abs"] * scale[3, 1].item())
    assert abs(deq[3, 1, 10].item() - 1e4) <= bound and torch.isfinite(deq).all()


@pytest.mark.parametrize("dtype", QUANT_KV_DTYPES, ids=IDS)
def test_zero_rows_do_not_divide_by_zero(dtype):
    codes, scale = quantize_kv(torch.zeros(2, 3, 64), dtype)
    assert (scale == MIN_SCALE).all()
    assert (dequantize_kv(codes, scale) == 0).all()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", QUANT_KV_DTYPES, ids=IDS)
def test_store_writes_codes_and_scales_at_slots(dtype, static):
    gen = torch.Generator().manual_seed(2)
    shape = (7, 16, 3, 64)
    key_cache = torch.zeros(shape, dtype=dtype)
    value_cache = torch.zeros(shape, dtype=dtype)
    if static:
        k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.07)
    else:  # NaN marks "never written"
        k_scale, v_scale = (torch.full(shape[:3], math.nan, dtype=torch.bfloat16),
                            torch.full(shape[:3], math.nan, dtype=torch.bfloat16))
    slots = torch.randperm(7 * 16, generator=gen)[:30]
    key = torch.randn(30, 3, 64, generator=gen).to(torch.bfloat16)
    value = torch.randn(30, 3, 64, generator=gen)
    reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    untouched = torch.ones(7 * 16, dtype=torch.bool)
    untouched[slots] = False
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        codes, s = quantize_kv(x, dtype, scale if static else None)
        flat = cache.view(-1, 3, 64)
        assert torch.equal(flat[slots].view(torch.uint8), codes.view(torch.uint8))
        assert (flat[untouched].view(torch.uint8) == 0).all()
        if not static:
            torch.testing.assert_close(scale.view(-1, 3)[slots], s, atol=0, rtol=0)
            assert scale.view(-1, 3)[untouched].isnan().all()
    if static:
        assert k_scale.item() == pytest.approx(0.05) and v_scale.item() == pytest.approx(0.07)


def check_against_dense(specs, cache_dtype, static, *, num_kv_heads, group, head_dim, block_size,
                        window=None, seed=0):
    args, (keys, values, queries) = make_kv_batch(
        specs, cache_dtype=cache_dtype, static=static, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, block_size=block_size, seed=seed)
    scale = head_dim**-0.5
    out = paged_attention(**args, scale=scale, sliding_window=window)
    # The oracle attends over the dequantized per-sequence K/V (the exact values the cache holds).
    expected = torch.cat([dense_attention(q, k, v, c, scale, window)
                          for (c, _), q, k, v in zip(specs, queries, keys, values)])
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", QUANT_KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(2, 1, 64, 16), (1, 3, 64, 32), (2, 8, 128, 16)])
def test_quantized_attention_matches_dense(dtype, static, num_kv_heads, group, head_dim, block_size):
    check_against_dense(MIXED, dtype, static, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                        block_size=block_size)


@pytest.mark.parametrize("window", [7, 50])
def test_quantized_attention_sliding_window(window):
    specs = MIXED + [(200, 150), (300, 1)]
    check_against_dense(specs, torch.int8, False, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                        window=window, seed=3)


def test_dequantizes_only_gathered_tokens(monkeypatch):
    """No full-precision copy of the cache: every dequantize_kv call sees gathered tokens only."""
    specs = [(0, 20), (40, 1), (9, 1), (30, 5)]
    args, _ = make_kv_batch(specs, cache_dtype=torch.int8, num_kv_heads=2, group=2, head_dim=64, block_size=16)
    # Grow the pool far beyond the batch (the extra blocks are never referenced).
    extra = 500
    for name, scale in (("key_cache", "k_scale"), ("value_cache", "v_scale")):
        args[name] = torch.cat([args[name], torch.zeros((extra,) + args[name].shape[1:], dtype=torch.int8)])
        args[scale] = torch.cat([args[scale], torch.zeros((extra,) + args[scale].shape[1:], dtype=args[scale].dtype)])
    seen = []

    def spy(codes, scale):
        seen.append(codes.numel())
        return dequantize_kv(codes, scale)

    monkeypatch.setattr(ref_attn, "dequantize_kv", spy)
    paged_attention(**args, scale=0.125)
    gathered_bound = sum(c + q for c, q in specs) * 2 * 64  # every key of every sequence, once
    assert seen and max(seen) <= gathered_bound < args["key_cache"].numel() // 50


def test_the_kv_dtype_table_agrees_with_torch_and_the_config():
    """kv_dtypes.KV_CACHE_DTYPES is the one table of cache dtypes: each code range is the format's
    own (torch.finfo / iinfo), the fp8 flag marks the 1-byte floats, and every name configures."""
    from pagedserve.core.config import CacheConfig
    from pagedserve.core.kv_cache.cache_tensors import resolve_kv_cache_dtype
    from pagedserve.kernels.kv_dtypes import KV_CACHE_DTYPE_NAMES, KV_CACHE_DTYPES

    assert {d.name for d in KV_CACHE_DTYPES.values()} == {"fp32", "bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"}
    for name, entry in KV_CACHE_DTYPES.items():
        dtype = entry.torch_dtype
        assert isinstance(dtype, torch.dtype)
        assert entry.fp8 == (dtype.is_floating_point and dtype.itemsize == 1), name
        if entry.quantized:
            info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
            assert entry.qmax == info.max and QUANT_MAX[dtype] == entry.qmax, name
        else:
            assert dtype.is_floating_point and dtype not in QUANT_MAX, name
        assert CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name
        assert resolve_kv_cache_dtype(name, torch.float32) is dtype
    assert KV_CACHE_DTYPE_NAMES == ("auto", *KV_CACHE_DTYPES)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
