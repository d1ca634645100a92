"""The fp32 AVX-512 linear kernel (kernels/cpu/fp32_linear.cpp) against a float64 matmul of the same
values. It sums each output in fp32 in blocks of 128 inputs, so its error must stay within what
fp32 summation allows, and no larger than torch's own fp32 matmul (MKL) makes on the same inputs.
Runs where the CPU has AVX-512; elsewhere prepack_linear must decline (tests/kernels/test_amx_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.core.layers.linear import Linear
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import fp32_available, prepack_linear

needs_avx512 = pytest.mark.skipif(not fp32_available(), reason="this CPU has no AVX-512 (prepack_linear declines)")


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


def assert_fp32_accurate(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = exact(x, w, bias)
    # Bound of a blocked fp32 sum: a few units of fp32 rounding times the sum of |terms|.
    scale = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
    err = (got.double() - want).abs()
    assert (err <= scale * 2e-6 + 1e-30).all(), f"max error {err.max().item():.3g}"
    torch_err = (F.linear(x, w, bias).double() - want).abs().max().item()
    assert err.max().item() <= max(2 * torch_err, 1e-6), (err.max().item(), torch_err)


@needs_avx512
@pytest.mark.parametrize("rows", [1, 5, 11, 12, 13, 24, 37, 95, 96, 97, 300])
@pytest.mark.parametrize("out_features,in_features", [(32, 7), (96, 64), (64, 576), (32, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_linear_matches_float64_matmul(rows, out_features, in_features, with_bias):
    w, x = randn(out_features, in_features, seed=1), randn(rows, in_features, seed=2)
    bias = randn(out_features, seed=3) if with_bias else None
    linear = prepack_linear(w)
    assert linear is not None
    got = linear(x, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert_fp32_accurate(got, x, w, bias)


@needs_avx512
def test_many_panels_split_across_threads_and_prefetched():
    """A wide layer (the LM head's shape class): every panel boundary and both threads' ranges."""
    w, x = randn(2048, 96, seed=4), randn(40, 96, seed=5)
    assert_fp32_accurate(prepack_linear(w)(x, None), x, w, None)


@needs_avx512
def test_non_contiguous_input_and_zero_rows():
    w = randn(64, 48, seed=6)
    linear = prepack_linear(w)
    x = randn(5, 96, seed=7)[:, ::2]  # a strided view: the kernel takes a contiguous copy
    assert_fp32_accurate(linear(x, None), x, w, None)
    assert linear(torch.empty(0, 48), None).shape == (0, 64)


@needs_avx512
def test_linear_keeps_only_the_packed_copy():
    w = randn(64, 32, seed=8)
    layer = Linear(w, prepack=prepack_linear)
    assert layer.kernel is not None and layer.weight is None and layer.packed is None
    assert layer.kernel.packed.numel() == w.numel()
    x = randn(3, 32, seed=9)
    assert_fp32_accurate(layer(x), x, w, None)


@needs_avx512
def test_packed_rows_are_the_weight_rows():
    """A tied embedding's lookup reads the packed LM head back: exactly weight[ids], any order."""
    w = randn(96, 40, seed=10)
    linear = prepack_linear(w)
    ids = torch.tensor([95, 0, 31, 32, 33, 63, 64, 0, 95])  # panel edges, repeats
    assert torch.equal(linear.rows(ids), w[ids])
    assert linear.rows(torch.empty(0, dtype=torch.long)).shape == (0, 40)
    with pytest.raises(RuntimeError, match="out of range"):
        linear.rows(torch.tensor([96]))


def test_fp32_packing_checks_its_arguments():
    if not fp32_available():
        pytest.skip("this CPU has no AVX-512")
    ext = load_extension()
    packed = ext.fp32_pack_weight(randn(64, 16, seed=11))
    with pytest.raises(RuntimeError, match="packed must be"):
        ext.fp32_linear(randn(2, 16, seed=12), packed, None, 32)
    with pytest.raises(RuntimeError, match="multiple of"):
        ext.fp32_pack_weight(randn(40, 16, seed=13))
    with pytest.raises(RuntimeError, match="float32"):
        ext.fp32_linear(randn(2, 16, seed=12).double(), packed, None, 64)
