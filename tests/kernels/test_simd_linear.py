"""The AVX-512 and AVX2 linear kernels (kernels/cpu/simd_linear.cpp) against a float64 matmul of
the same values. All sum each output in fp32 in blocks of 128 inputs, so every output must lie
within the bound of such a sum (tests/kernels/linear_oracle.py); bf16 outputs are then rounded once
to bf16. Nothing here compares with another library's error, which depends on the host. Where AMX runs,
fp32_linear hands calls of fp32_amx_min_rows() rows or more to amx_fp32_linear.cpp, whose outputs
are held to that kernel's own bound (test_amx_fp32_linear.py).

Every kernel that runs on this CPU is tested, whichever the CPU prefers
(test_bf16_kernel_choice_follows_native_bf16, test_fp32_takes_avx2_where_there_is_no_avx512):
fp32 on AVX-512 and on AVX2 (which every AVX-512 CPU also runs), bf16 in fp32 math, and bf16 by
pair dot products (vdpbf16ps with AVX512-BF16, else its emulation, which exercises the same
packing and blocking). Without AVX-512 prepack_linear declines bf16 where AMX is missing too
(tests/kernels/test_amx_linear.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.layers.linear import Linear
from pagedserve.kernels.cpu import linear as cpu_linear
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import (AMX_BF16, AVX2_FP32, AVX512_BF16_DOT, AVX512_BF16_FP32_MATH, AVX512_FP32,
                                           avx512_available, packed_linear, prepack_linear)

from tests.kernels.linear_oracle import assert_bf16_rounded_once, assert_fp32_accurate, assert_fp32_split_accurate, exact

needs_avx512 = pytest.mark.skipif(not avx512_available(), reason="this CPU has no AVX-512 (prepack_linear declines)")
needs_avx2 = pytest.mark.skipif(AVX2_FP32 not in cpu_linear.runnable_kernels(torch.float32),
                                reason="this CPU has no AVX2 with FMA")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# What each dtype's outputs must be, and the kernels (with their dtype) the tests run.
ACCURATE = {torch.float32: assert_fp32_accurate, torch.bfloat16: assert_bf16_rounded_once}
BF16_KERNELS = [pytest.param(AVX512_BF16_FP32_MATH, torch.bfloat16, marks=needs_avx512, id="bf16-fp32-math"),
                pytest.param(AVX512_BF16_DOT, torch.bfloat16, marks=needs_avx512, id="bf16-dot")]
FP32_KERNELS = [pytest.param(AVX512_FP32, torch.float32, marks=needs_avx512, id="fp32"),
                pytest.param(AVX2_FP32, torch.float32, marks=needs_avx2, id="avx2-fp32")]
KERNELS = [*FP32_KERNELS, *BF16_KERNELS]


# Rows: AVX-512 blocks of 12 (1, 5, 11-13, 24), AVX2 slices of 6 rows over half panels or 3 over
# whole ones (2-4, 6, 7, 9), chunks of up to 96 rows balanced in whole blocks (95-97, 128, 300).
@pytest.mark.parametrize("kernel,dtype", FP32_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 24, 37, 95, 96, 97, 128, 300])
@pytest.mark.parametrize("out_features,in_features", [(32, 7), (96, 64), (64, 576), (32, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_linear_matches_float64_matmul(kernel, dtype, rows, out_features, in_features, with_bias):
    w, x = randn(out_features, in_features, seed=1), randn(rows, in_features, seed=2)
    bias = randn(out_features, seed=3) if with_bias else None
    linear = packed_linear(kernel, w)
    got = linear(x, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    if kernel is AVX512_FP32 and cpu_linear.amx_available() and rows >= load_extension().fp32_amx_min_rows():
        assert_fp32_split_accurate(got, x, w, bias)  # fp32_linear ran amx_fp32_linear.cpp's sums
    else:
        assert_fp32_accurate(got, x, w, bias)


@pytest.mark.parametrize("kernel,dtype", BF16_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 37, 97, 300])
@pytest.mark.parametrize("out_features,in_features", [(32, 2), (96, 64), (64, 578), (32, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_is_the_exact_product_rounded_once(kernel, dtype, rows, out_features, in_features, with_bias):
    w = randn(out_features, in_features, seed=1, dtype=dtype)
    x = randn(rows, in_features, seed=2, dtype=dtype)
    bias = randn(out_features, seed=3, dtype=dtype) if with_bias else None
    linear = packed_linear(kernel, w)
    assert linear.packed.dtype == torch.bfloat16
    got = linear(x, bias)
    assert got.shape == (rows, out_features)
    assert_bf16_rounded_once(got, x, w, bias)


@needs_avx512
def test_bf16_odd_in_features_keep_torchs_matmul():
    """bf16 panels hold k values in pairs (AMX tiles in slices of 32): an odd in_features is no
    kernel's."""
    assert prepack_linear(randn(64, 7, seed=4, dtype=torch.bfloat16)) is None


@needs_avx512
@pytest.mark.parametrize("native", [False, True])
def test_bf16_kernel_choice_follows_native_bf16(monkeypatch, native):
    """With bf16 dot products (AVX512-BF16) and no AMX, bf16 layers take the dot-product kernel;
    without them, the fp32-math kernel (oneDNN's bf16 matmul would emulate bf16, 3.5x slower). AMX,
    where it runs, comes first. fp32 layers take the fp32 kernel either way."""
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: native)
    cpu_linear._available.cache_clear()
    try:
        expected = AVX512_BF16_DOT if native else AVX512_BF16_FP32_MATH
        if cpu_linear._available(AMX_BF16):
            expected = AMX_BF16
        assert prepack_linear(randn(64, 32, seed=4, dtype=torch.bfloat16)).kernel is expected
        assert prepack_linear(randn(64, 32, seed=4)).kernel is AVX512_FP32
    finally:
        monkeypatch.undo()
        cpu_linear._available.cache_clear()


@pytest.mark.parametrize("kernel,dtype", KERNELS)
def test_many_panels_split_across_threads_and_prefetched(kernel, dtype):
    """A wide layer (the LM head's shape class): every panel boundary and both threads' ranges."""
    w, x = randn(2048, 96, seed=4, dtype=dtype), randn(40, 96, seed=5, dtype=dtype)
    ACCURATE[dtype](packed_linear(kernel, w)(x, None), x, w, None)


@pytest.mark.parametrize("kernel,dtype", KERNELS)
def test_non_contiguous_input_and_zero_rows(kernel, dtype):
    w = randn(64, 48, seed=6, dtype=dtype)
    linear = packed_linear(kernel, w)
    x = randn(5, 96, seed=7, dtype=dtype)[:, ::2]  # a strided view: the kernel takes a contiguous copy
    ACCURATE[dtype](linear(x, None), x, w, None)
    empty = linear(torch.empty(0, 48, dtype=dtype), None)
    assert empty.shape == (0, 64) and empty.dtype == dtype


@pytest.mark.parametrize("kernel,dtype", KERNELS)
def test_non_finite_inputs_give_what_the_exact_product_gives(kernel, dtype):
    """NaN and infinities pass through the sums and (bf16) the rounding: NaN stays NaN, never a
    finite value or an infinity of the wrong sign."""
    w, x = randn(64, 40, seed=15, dtype=dtype), randn(4, 40, seed=16, dtype=dtype)
    w[3] = w[3].abs()  # column 3 sums an infinity without cancelling it
    x[0, 5], x[1, 7], x[2, 9] = float("nan"), float("inf"), -float("inf")
    got, want = packed_linear(kernel, w)(x, None).double(), exact(x, w, None)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isposinf(), want.isposinf())
    assert torch.equal(got.isneginf(), want.isneginf()) and got[0].isnan().all() and got[1, 3] == float("inf")


needs_amx = pytest.mark.skipif(not cpu_linear.amx_available(), reason="this CPU has no AMX bf16")


@pytest.mark.parametrize("kernel,dtype", [*KERNELS, pytest.param(AMX_BF16, torch.bfloat16, marks=needs_amx, id="amx")])
@pytest.mark.parametrize("rows", [1, 13, 64, 97])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_out_is_the_layers_result_widened(kernel, dtype, rows, with_bias):
    """fp32_out (the LM head's logits, Linear.float_out): a bf16 layer's results rounded to bf16
    as ever, returned as fp32 (bit for bit what .float() of the bf16 result gives, non-finite
    values included); an fp32 layer's results unchanged. Each output's value is checked by the
    tests above against the exact product."""
    w, x = randn(2048, 64, seed=17, dtype=dtype), randn(rows, 64, seed=18, dtype=dtype)
    x[0, 3] = float("nan")
    if rows > 1:
        x[1, 5] = float("inf")
    bias = randn(2048, seed=19, dtype=dtype) if with_bias else None
    linear = packed_linear(kernel, w)
    widened = linear(x, bias, fp32_out=True)
    assert widened.dtype == torch.float32 and widened.shape == (rows, 2048)
    plain = linear(x, bias).float()
    assert torch.equal(widened.isnan(), plain.isnan()) and plain[0].isnan().all()
    assert torch.equal(widened.nan_to_num(), plain.nan_to_num())
    assert linear(x[:0], bias, fp32_out=True).dtype == torch.float32
    layer = Linear(w, bias, prepack=lambda weight: packed_linear(kernel, weight))
    assert torch.equal(layer.float_out(x[1:]), plain[1:])


@pytest.mark.parametrize("kernel,dtype", [*KERNELS, pytest.param(AMX_BF16, torch.bfloat16, marks=needs_amx, id="amx")])
def test_out_is_written_and_returned(kernel, dtype):
    """out: the result written into the caller's tensor (the LM head's reused logits buffer) and
    returned, equal to a fresh call's; a wrong dtype or shape is refused by name."""
    w, x = randn(256, 64, seed=22, dtype=dtype), randn(9, 64, seed=23, dtype=dtype)
    linear = packed_linear(kernel, w)
    out = torch.full((9, 256), float("nan"))
    got = linear(x, None, fp32_out=True, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, linear(x, None).float())
    if dtype == torch.bfloat16:
        plain = torch.empty(9, 256, dtype=dtype)
        assert linear(x, None, out=plain).data_ptr() == plain.data_ptr() and torch.equal(plain, linear(x, None))
    for bad in (torch.empty(9, 256, dtype=torch.float64), torch.empty(8, 256), torch.empty(256, 9).t()):
        with pytest.raises(RuntimeError, match="out must be a contiguous"):
            linear(x, None, fp32_out=True, out=bad)


def test_float_out_falls_back_to_float_where_the_kernel_cannot_widen():
    """Linear.float_out on a layer without a packed kernel (torch's matmul here) is self(x).float(),
    written into `out` when given (the int8 kernels take this path too)."""
    w, x = randn(64, 7, seed=20, dtype=torch.bfloat16), randn(3, 7, seed=21, dtype=torch.bfloat16)
    layer = Linear(w, pack=False)
    got = layer.float_out(x)
    assert got.dtype == torch.float32 and torch.equal(got, layer(x).float())
    out = torch.full((3, 64), float("nan"))
    assert layer.float_out(x, out).data_ptr() == out.data_ptr() and torch.equal(out, got)


@needs_avx2
@pytest.mark.parametrize("avx512", [True, False])
def test_fp32_takes_avx2_where_there_is_no_avx512(monkeypatch, avx512):
    """fp32 layers take the AVX-512 kernel where it runs, else the AVX2 one (over the same packed
    layout); bf16 layers never take the AVX2 kernel."""
    runs_here = cpu_linear._runs_here
    monkeypatch.setattr(cpu_linear, "_runs_here", lambda k: runs_here(k) and (avx512 or not k.run.startswith(
        ("fp32_linear", "bf16_linear", "bf16_dot_linear"))))
    cpu_linear._available.cache_clear()
    try:
        expected = AVX512_FP32 if avx512 and avx512_available() else AVX2_FP32
        w, x = randn(64, 40, seed=4), randn(9, 40, seed=5)
        linear = prepack_linear(w)
        assert linear.kernel is expected
        assert_fp32_accurate(linear(x, None), x, w, None)
        bf16 = prepack_linear(randn(64, 40, seed=4, dtype=torch.bfloat16))
        assert bf16 is None or bf16.kernel is not AVX2_FP32
    finally:
        monkeypatch.undo()
        cpu_linear._available.cache_clear()


@needs_avx2
def test_linear_keeps_only_the_packed_copy():
    w = randn(64, 32, seed=8)
    layer = Linear(w, prepack=prepack_linear)
    assert layer.kernel is not None and layer.weight is None and layer.packed is None
    assert layer.kernel.packed.numel() == w.numel()
    x = randn(3, 32, seed=9)
    assert_fp32_accurate(layer(x), x, w, None)


@pytest.mark.parametrize("kernel,dtype", KERNELS)
def test_packed_rows_are_the_weight_rows(kernel, dtype):
    """A tied embedding's lookup reads the packed LM head back: exactly weight[ids], any order."""
    w = randn(96, 40, seed=10, dtype=dtype)
    linear = packed_linear(kernel, w)
    ids = torch.tensor([95, 0, 31, 32, 33, 63, 64, 0, 95, 15, 16, 47, 48])  # panel and half-panel edges, repeats
    assert torch.equal(linear.rows(ids), w[ids])
    assert linear.rows(torch.empty(0, dtype=torch.long)).shape == (0, 40)
    with pytest.raises(RuntimeError, match="out of range"):
        linear.rows(torch.tensor([96]))


@pytest.mark.parametrize("kernel,dtype", KERNELS)
def test_packing_checks_its_arguments(kernel, dtype):
    ext = load_extension()
    pack, run = getattr(ext, kernel.pack), getattr(ext, kernel.run)
    packed = pack(randn(64, 16, seed=11, dtype=dtype))
    with pytest.raises(RuntimeError, match="packed must be"):
        run(randn(2, 16, seed=12, dtype=dtype), packed, None, 32)
    with pytest.raises(RuntimeError, match="multiple of"):
        pack(randn(40, 16, seed=13, dtype=dtype))
    with pytest.raises(RuntimeError, match=f"{str(dtype).removeprefix('torch.')} tensor, got float64"):
        run(randn(2, 16, seed=12).double(), packed, None, 64)
    with pytest.raises(RuntimeError, match="bias must be"):
        run(randn(2, 16, seed=12, dtype=dtype), packed, randn(64, seed=14).double(), 64)
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="in_features of 2"):
            pack(randn(64, 15, seed=13, dtype=dtype))
