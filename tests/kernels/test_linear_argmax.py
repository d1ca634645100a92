"""The linear kernels' fused argmax (the *_linear_argmax entry points, kernels/cpu/row_argmax.h:
greedy tokens from the LM head without storing the logits) against torch's max(dim=-1).indices
over the kernel's own stored result. That result is checked against the exact product by
test_simd_linear.py / test_amx_linear.py; here the fold must pick the same column from it: the
bf16 rounding applied before comparing, the first of equal maxima (ties inside a panel, across
panels and across the threads' column ranges), a row's first NaN, all -inf rows, and the bias."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.layers.linear import Linear
from pagedserve.kernels.cpu import linear as cpu_linear
from pagedserve.kernels.cpu.linear import (AMX_BF16, AVX2_FP32, AVX512_BF16_DOT, AVX512_BF16_FP32_MATH, AVX512_FP32,
                                           packed_linear)
from pagedserve.kernels.reference.sampling import argmax_rows

needs_avx512 = pytest.mark.skipif(not cpu_linear.avx512_available(), reason="this CPU has no AVX-512")
needs_amx = pytest.mark.skipif(not cpu_linear.amx_available(), reason="this CPU has no AMX bf16")
ARGMAX_KERNELS = [pytest.param(AVX512_FP32, torch.float32, marks=needs_avx512, id="fp32"),
                  pytest.param(AVX512_BF16_FP32_MATH, torch.bfloat16, marks=needs_avx512, id="bf16-fp32-math"),
                  pytest.param(AVX512_BF16_DOT, torch.bfloat16, marks=needs_avx512, id="bf16-dot"),
                  pytest.param(AMX_BF16, torch.bfloat16, marks=needs_amx, id="amx")]


def randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def stored_argmax(linear, x, bias):
    """The oracle: torch's argmax rule over what the kernel stores (widened from bf16)."""
    return argmax_rows(linear(x, bias).float())


@pytest.mark.parametrize("kernel,dtype", ARGMAX_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 13, 33, 64, 97, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_argmax_is_the_stored_results_argmax(kernel, dtype, rows, with_bias, threads):
    """Rows: AMX tiles of 16 and blocks of 32, AVX-512 blocks of 12 and chunks of 96. Columns 1024
    on are a copy of columns 0-1023 and column 7 a copy of column 3: every row's maximum is tied
    (two threads split the 2048 columns at 1024), and the first must win."""
    w, x = randn(2048, 64, seed=1, dtype=dtype), randn(rows, 64, seed=2, dtype=dtype)
    w[7] = w[3]
    w[1024:] = w[:1024]
    bias = None
    if with_bias:
        bias = randn(1024, seed=3, dtype=dtype).repeat(2)
    linear = packed_linear(kernel, w)
    got = linear.argmax(x, bias)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    want = stored_argmax(linear, x, bias)
    assert torch.equal(got, want)
    assert (want < 1024).all()  # the tie really was there, and the earlier copy won


@pytest.mark.parametrize("kernel,dtype", ARGMAX_KERNELS)
def test_bf16_rounding_ties_pick_the_first(kernel, dtype, threads):
    """Sums that differ in fp32 but round to the same bf16 value are equal logits: the first wins,
    as it does over the stored bf16 logits (fp32 layers compare their exact sums)."""
    x = torch.ones(3, 64, dtype=dtype)
    w = torch.zeros(512, 64, dtype=dtype)
    w[40, 0], w[300, 0] = 3.0, 3.0
    w[300, 1] = 2.0**-10  # 3 + 2^-10: the same bf16 value as 3, larger in fp32
    linear = packed_linear(kernel, w)
    want = stored_argmax(linear, x, None)
    assert torch.equal(linear.argmax(x, None), want)
    assert want.tolist() == ([40] * 3 if dtype == torch.bfloat16 else [300] * 3)


@pytest.mark.parametrize("kernel,dtype", ARGMAX_KERNELS)
def test_non_finite_rows(kernel, dtype, threads):
    """A row of NaN (NaN input): its first column. A NaN weight row (column 1500 NaN for every
    row): that column, unless a row has an earlier NaN. An +inf column: the first +inf. A bias of
    -inf everywhere: every logit -inf, the first column."""
    w, x = randn(2048, 32, seed=4, dtype=dtype), randn(4, 32, seed=5, dtype=dtype)
    x[0, 3] = float("nan")
    linear = packed_linear(kernel, w)
    assert torch.equal(linear.argmax(x, None), stored_argmax(linear, x, None))
    assert linear.argmax(x, None)[0] == 0

    w_nan = w.clone()
    w_nan[1500, 7] = float("nan")
    w_nan[1700] = w_nan[1700].abs()
    x_inf = x.clone()
    x_inf[2, 4] = float("inf")
    x_inf[2] = x_inf[2].abs()
    linear = packed_linear(kernel, w_nan)
    got = linear.argmax(x_inf, None)
    assert torch.equal(got, stored_argmax(linear, x_inf, None))
    assert got.tolist()[1] == 1500 and got.tolist()[0] == 0

    all_neg_inf = torch.full((2048,), float("-inf"), dtype=dtype)
    linear = packed_linear(kernel, w)
    assert linear.argmax(x[1:], all_neg_inf).tolist() == [0, 0, 0]


@pytest.mark.parametrize("kernel,dtype", ARGMAX_KERNELS)
def test_zero_rows_and_bad_arguments(kernel, dtype):
    w = randn(64, 32, seed=6, dtype=dtype)
    linear = packed_linear(kernel, w)
    empty = linear.argmax(torch.empty(0, 32, dtype=dtype), None)
    assert empty.shape == (0,) and empty.dtype == torch.int64
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="_linear_argmax: x must be"):
        linear.argmax(torch.zeros(2, 32, dtype=other), None)
    with pytest.raises(RuntimeError, match="_linear_argmax: bias must be"):
        linear.argmax(torch.zeros(2, 32, dtype=dtype), torch.zeros(63, dtype=dtype))


@pytest.mark.parametrize("kernel,dtype", [*ARGMAX_KERNELS, pytest.param(None, torch.bfloat16, id="torch-matmul")])
def test_linear_argmax_takes_the_fused_kernel_or_falls_back(kernel, dtype):
    """Linear.argmax: the kernel's fold where it has one, else argmax_rows over float_out (torch's
    matmul here, the AVX2 kernel, the int8 kernels); the same tokens either way."""
    w, x = randn(256, 64, seed=7, dtype=dtype), randn(9, 64, seed=8, dtype=dtype)
    calls = []

    def counted(logits):
        calls.append(logits.shape)
        return argmax_rows(logits)

    layer = Linear(w, prepack=(lambda weight: packed_linear(kernel, weight)) if kernel is not None else None)
    got = layer.argmax(x, counted)
    assert torch.equal(got, argmax_rows(layer.float_out(x)))
    assert calls == ([] if kernel is not None else [(9, 256)])


@pytest.mark.skipif(AVX2_FP32 not in cpu_linear.runnable_kernels(torch.float32), reason="this CPU has no AVX2 with FMA")
def test_the_avx2_kernel_has_no_fused_argmax():
    """AVX2-only CPUs keep the logits and argmax_rows (the fold is AVX-512 code)."""
    assert AVX2_FP32.argmax is None
    linear = packed_linear(AVX2_FP32, randn(64, 32, seed=9, dtype=torch.float32))
    assert not hasattr(linear, "argmax")
