"""Triton kernels against their pure-torch twins (kernels/reference), every KV cache dtype.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py) on small
shapes; the interpreter runs every dtype used here (int8 and both fp8 formats included), so
nothing is skipped. One interpreter gap is worked around in the launcher, not skipped: triton
3.9's interpreter multiplies bf16 `tl.dot` operands as raw uint16 bit patterns, so off CUDA a
bf16 query's dots run in fp32 (attention._fp32_dot); the 16-bit dot path itself is covered here
by the fp16 cases and on a GPU by bench/gpu_check.sh. (Its fp32->fp8/bf16 casts are handled by
rounding in the kernel, which is the code path every backend runs.) bench/gpu_check.sh runs this file on a GPU with PAGEDSERVE_FULL_KERNEL_TESTS=1
(longer sequences, the full parameter grid, the device's real split-K heuristic as well).

Batches come from quant_batches.make_kv_batch: mixed prefill chunks / decodes / idle sequences,
partial last blocks, block tables that are random permutations with stale entries, and poisoned
unused slots (any stray read gives NaN).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

import pagedserve.kernels.triton.attention as tri_attn  # noqa: E402
from pagedserve.kernels import reference, triton as tri  # noqa: E402
from pagedserve.kernels.kv_quant import QUANT_MAX, is_quantized  # noqa: E402
from tests.kernels.quant_batches import FLOAT_KV_DTYPES, QUANT_KV_DTYPES, make_kv_batch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
FULL = os.environ.get("PAGEDSERVE_FULL_KERNEL_TESTS") == "1"

# Attention output tolerances by query dtype. Both sides read the very same cache values
# (quantized caches: the same codes and scales), so the differences are fp32 summation order plus,
# for 16-bit queries, the Triton kernel's 16-bit P @ V operands and the output rounding.
ATTN_TOL = {
    torch.float32: dict(atol=3e-5, rtol=3e-5) if DEVICE.type == "cpu" else dict(atol=2e-4, rtol=2e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
# Store tolerances, in the dequantized values (code * scale). The interpreter must match the
# reference bit for bit (same nearest-even rounding); a GPU may divide by the scale with another
# rounding, so there one code step (int8: 1 * scale) or one fp8 ulp (relative 2^-3 / 2^-2) is allowed.
STORE_TOL = {
    torch.float32: dict(atol=0, rtol=0), torch.bfloat16: dict(atol=0, rtol=0), torch.float16: dict(atol=0, rtol=0),
    torch.int8: dict(atol=1.01 / QUANT_MAX[torch.int8], rtol=0),  # scales are amax / 127 with |x| <~ 4
    torch.float8_e4m3fn: dict(atol=1e-6, rtol=2.0**-3),
    torch.float8_e5m2: dict(atol=1e-6, rtol=2.0**-2),
}

# (context_len, q_len) per sequence.
MIXED = [(0, 37), (40, 1), (33, 0), (0, 1), (63, 1), (17, 25), (150, 1), (0, 0), (5, 1), (31, 2)]
if FULL:
    MIXED = MIXED + [(2000, 1), (1500, 300), (700, 1), (4000, 1), (0, 513)]


@pytest.fixture
def force_splits(monkeypatch):
    def force(n: int | None) -> None:
        if n is not None:
            monkeypatch.setattr(tri_attn, "num_splits", lambda *a: n)
    return force


def run_both(args, scale, window=None, softcap=None):
    ref = reference.paged_attention(**args, scale=scale, sliding_window=window, softcap=softcap)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = tri.paged_attention(**dev, scale=scale, sliding_window=window, softcap=softcap)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == DEVICE
    assert torch.isfinite(ref).all()
    return out.cpu(), ref


SHAPES = [(2, 1, 64, 16, 1), (1, 3, 64, 32, 3), (1, 8, 128, 16, 2), (2, 8, 128, 32, 1)]
if FULL:
    SHAPES += [(4, 1, 128, 16, None), (8, 3, 64, 32, None), (2, 3, 128, 16, None), (1, 8, 64, 32, 7)]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,splits", SHAPES)
def test_attention_shapes(force_splits, num_kv_heads, group, head_dim, block_size, splits):
    """GQA 1/3/8, head_dim 64/128, block 16/32, with and without split-K; fp32 cache and query."""
    force_splits(splits)
    args, _ = make_kv_batch(MIXED, cache_dtype=torch.float32, num_kv_heads=num_kv_heads, group=group,
                            head_dim=head_dim, block_size=block_size, seed=1)
    out, ref = run_both(args, head_dim**-0.5)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


# (cache dtype, query dtype, static scales): 16-bit caches with their own query dtype, quantized
# caches under fp32 and bf16 queries, per-slot dynamic and per-tensor static scales.
DTYPE_CASES = [
    (torch.bfloat16, torch.bfloat16, False), (torch.float16, torch.float16, False),
    (torch.int8, torch.float32, False), (torch.int8, torch.bfloat16, False), (torch.int8, torch.float32, True),
    (torch.float8_e4m3fn, torch.float32, False), (torch.float8_e4m3fn, torch.float16, True),
    (torch.float8_e5m2, torch.float32, False),
]


@pytest.mark.parametrize("cache_dtype,query_dtype,static", DTYPE_CASES, ids=[
    f"{str(c).removeprefix('torch.')}-q_{str(q).removeprefix('torch.')}-{'static' if s else 'dynamic'}"
    for c, q, s in DTYPE_CASES])
def test_attention_kv_dtypes(force_splits, cache_dtype, query_dtype, static):
    force_splits(2)
    args, _ = make_kv_batch(MIXED, cache_dtype=cache_dtype, query_dtype=query_dtype, static=static,
                            num_kv_heads=1, group=3, head_dim=64, block_size=16, seed=2)
    out, ref = run_both(args, 0.125)
    torch.testing.assert_close(out, ref, **ATTN_TOL[query_dtype])


@pytest.mark.parametrize("window,splits", [(7, 1), (40, 3)])
def test_attention_sliding_window(force_splits, window, splits):
    force_splits(splits)
    specs = [(0, 30), (70, 1), (100, 20), (3, 1)]
    args, _ = make_kv_batch(specs, cache_dtype=torch.int8, num_kv_heads=2, group=2, head_dim=64,
                            block_size=16, seed=3)
    out, ref = run_both(args, 0.125, window)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


@pytest.mark.parametrize("head_dim,window,softcap,splits", [(32, None, 1.5, 1), (64, 7, 2.0, 3), (256, 20, None, 2),
                                                       (256, 20, 3.0, 1)])
def test_attention_gemma_options(force_splits, head_dim, window, softcap, splits):
    """Gemma's attention: scores softcapped (Gemma 2; caps below the scaled scores of this batch,
    so the cap acts), head_dim 256 and a window shorter than the prompts (Gemma 3), a scale that
    is not head_dim ** -0.5 (query_pre_attn_scalar)."""
    force_splits(splits)
    specs = [(0, 30), (70, 1), (40, 20), (3, 1)]
    args, _ = make_kv_batch(specs, cache_dtype=torch.float32, num_kv_heads=2, group=2, head_dim=head_dim,
                            block_size=16, seed=4)
    scale = 1.5 * head_dim**-0.5
    out, ref = run_both(args, scale, window, softcap)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])
    if softcap is not None:  # the cap changed the result: it was exercised
        uncapped = reference.paged_attention(**args, scale=scale, sliding_window=window)
        assert (uncapped - ref).abs().max() > 1e-2


def test_attention_long_decodes_split_k(force_splits):
    """A few long decodes: more splits than some sequences have tiles (empty splits must not count)."""
    force_splits(5)
    specs = [(300, 1), (10, 1), (129, 1), (64, 1)]
    args, _ = make_kv_batch(specs, cache_dtype=torch.float8_e4m3fn, num_kv_heads=2, group=8, head_dim=64,
                            block_size=32, seed=4)
    out, ref = run_both(args, 0.125)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


def test_attention_only_empty_sequences():
    args, _ = make_kv_batch([(0, 0), (20, 0)], cache_dtype=torch.int8, num_kv_heads=2, group=2,
                            head_dim=64, block_size=16)
    out, ref = run_both(args, 0.125)
    assert out.shape == ref.shape == (0, 4, 64)


STORE_CASES = [(d, False) for d in FLOAT_KV_DTYPES + QUANT_KV_DTYPES] + [(d, True) for d in QUANT_KV_DTYPES]


@pytest.mark.parametrize("cache_dtype,static", STORE_CASES, ids=[
    f"{str(d).removeprefix('torch.')}-{'static' if s else 'dynamic'}" for d, s in STORE_CASES])
def test_store_matches_reference(cache_dtype, static):
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 64
    num_tokens = 40
    # K and V as strided views of one fused projection, as the model produces them; a few outlier
    # tokens (saturate under a static scale) and one all-zero token (scale floor, no 0/0).
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen)
    fused[3] *= 50.0
    fused[7] = 0.0
    key = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def fresh():
        caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
        if not is_quantized(cache_dtype):
            return caches + [None, None]
        if static:
            return caches + [torch.tensor(0.02), torch.tensor(0.03)]
        return caches + [torch.full(shape[:3], -1.0, dtype=torch.bfloat16) for _ in range(2)]

    expected = fresh()
    reference.reshape_and_cache(key, value, *expected[:2], slots, *expected[2:])
    got = [t.to(DEVICE) if t is not None else None for t in fresh()]
    tri.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), got[0], got[1], slots.to(DEVICE), got[2], got[3])
    got = [t.cpu() if t is not None else None for t in got]
    exact = DEVICE.type == "cpu"
    for cache, ref, scale, ref_scale in ((got[0], expected[0], got[2], expected[2]),
                                         (got[1], expected[1], got[3], expected[3])):
        if not is_quantized(cache_dtype):
            torch.testing.assert_close(cache, ref, atol=0, rtol=0)
            continue
        # Same bf16 scale bits on CPU; on a GPU a 1-ulp fp32 difference may round up one bf16 step.
        torch.testing.assert_close(scale, ref_scale, atol=0, rtol=0 if exact else 2.0**-7)
        if exact:
            torch.testing.assert_close(cache.view(torch.uint8), ref.view(torch.uint8), atol=0, rtol=0)
        deq = cache.float() * (scale if static else scale[..., None])
        ref_deq = ref.float() * (ref_scale if static else ref_scale[..., None])
        tol = dict(STORE_TOL[cache_dtype])
        if cache_dtype == torch.int8:  # one code step of the largest scale
            tol["atol"] = float(ref_scale.abs().max()) * 1.01
        torch.testing.assert_close(deq, ref_deq, **tol)
        assert torch.isfinite(deq).all()


def test_engine_flow_store_then_attend(force_splits):
    """Step by step as the engine runs it, int8 cache: each step stores through the Triton store
    kernel and attends with the Triton kernel; the reference does the same on its own cache."""
    force_splits(2)
    gen = torch.Generator().manual_seed(6)
    num_kv_heads, group, head_dim, block_size, num_blocks = 2, 3, 64, 16, 24
    schedule = [[30, 17, 0], [1, 0, 40], [20, 1, 1], [1, 1, 1]]
    block_table = torch.randperm(num_blocks, generator=gen)[:18].view(3, 6).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = {name: [torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
                     torch.zeros(shape[:3], dtype=torch.bfloat16), torch.zeros(shape[:3], dtype=torch.bfloat16)]
              for name in ("ref", "tri")}
    caches["tri"] = [t.to(DEVICE) for t in caches["tri"]]
    done = [0, 0, 0]
    for step in schedule:
        slot_mapping = torch.cat([
            block_table[b].long()[torch.arange(done[b], done[b] + n) // block_size] * block_size
            + torch.arange(done[b], done[b] + n) % block_size for b, n in enumerate(step)])
        n_tok = sum(step)
        key = torch.randn(n_tok, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(n_tok, num_kv_heads, head_dim, generator=gen)
        query = torch.randn(n_tok, num_kv_heads * group, head_dim, generator=gen)
        for b, n in enumerate(step):
            done[b] += n
        meta = (block_table, torch.tensor([0] + step, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                torch.tensor(done, dtype=torch.int32))
        kc, vc, ks, vs = caches["ref"]
        reference.reshape_and_cache(key, value, kc, vc, slot_mapping, ks, vs)
        ref = reference.paged_attention(query, kc, vc, *meta, 0.125, max(step), max(done), None, ks, vs)
        kc, vc, ks, vs = caches["tri"]
        tri.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), kc, vc, slot_mapping.to(DEVICE), ks, vs)
        out = tri.paged_attention(query.to(DEVICE), kc, vc, *(m.to(DEVICE) for m in meta), 0.125, max(step),
                                  max(done), None, ks, vs)
        torch.testing.assert_close(out.cpu(), ref, **ATTN_TOL[torch.float32])


def test_launchers_assert_contracts():
    args, _ = make_kv_batch([(3, 2)], cache_dtype=torch.int8, num_kv_heads=1, group=2, head_dim=64, block_size=16)
    with pytest.raises(AssertionError, match="block_table"):
        tri.paged_attention(**{**args, "block_table": args["block_table"].long()}, scale=0.125)
    with pytest.raises(AssertionError, match="k_scale"):
        tri.paged_attention(**{**args, "k_scale": None, "v_scale": None}, scale=0.125)
    with pytest.raises(AssertionError, match="k_scale"):
        tri.paged_attention(**{**args, "k_scale": args["k_scale"].double()}, scale=0.125)
    key = torch.randn(2, 1, 64)
    with pytest.raises(AssertionError, match="slot_mapping"):
        tri.reshape_and_cache(key, key, args["key_cache"], args["value_cache"], torch.tensor([0, 1], dtype=torch.int32),
                              args["k_scale"], args["v_scale"])
    with pytest.raises(AssertionError, match="takes no k_scale"):
        fp = torch.zeros(2, 16, 1, 64)
        tri.reshape_and_cache(key, key, fp, fp.clone(), torch.tensor([0, 1]), args["k_scale"], args["v_scale"])
