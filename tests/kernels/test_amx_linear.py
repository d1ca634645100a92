"""The AMX bf16 linear kernel (kernels/cpu/amx_linear.cpp) against the exact product of the same
bf16 values: it accumulates in fp32 (tdpbf16ps, 32-value slices) and rounds once to bf16, so every
output is the exact product rounded to bf16 but where the fp32 sum's error reaches a rounding
midpoint (tests/kernels/linear_oracle.py). Runs where the CPU has AMX (Sapphire Rapids and later);
elsewhere prepack_linear must decline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.core.layers.linear import Linear
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import amx_available, prepack_linear

from tests.kernels.linear_oracle import assert_bf16_rounded_once

needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU has no AMX bf16 (prepack_linear declines)")


def bf16(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def oracle(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 56, 64, 100, 300])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (96, 64), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_matches_fp32_matmul(rows, out_features, in_features, with_bias):
    w, x = bf16(out_features, in_features, seed=1), bf16(rows, in_features, seed=2)
    bias = bf16(out_features, seed=3) if with_bias else None
    linear = prepack_linear(w)
    assert linear is not None
    got = linear(x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert_bf16_rounded_once(got, x, w, bias)


@needs_amx
def test_non_contiguous_input_and_zero_rows():
    w = bf16(64, 64, seed=4)
    linear = prepack_linear(w)
    wide = bf16(5, 128, seed=5)
    x = wide[:, ::2]  # a strided view: the kernel takes a contiguous copy
    assert_bf16_rounded_once(linear(x, None), x, w, None)
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16), None).shape == (0, 64)


@needs_amx
def test_linear_keeps_only_the_packed_copy():
    w = bf16(64, 32, seed=6)
    layer = Linear(w, prepack=prepack_linear)
    assert layer.kernel is not None and layer.weight is None and layer.packed is None
    assert layer.kernel.packed.numel() == w.numel()
    x = bf16(3, 32, seed=7)
    assert_bf16_rounded_once(layer(x), x, w, None)


@pytest.mark.parametrize("shape,dtype", [((200, 96), torch.bfloat16), ((64, 47), torch.bfloat16),
                                         ((40, 64), torch.float32), ((64, 64), torch.float16)])
def test_declines_what_it_cannot_run(shape, dtype):
    """Off every kernel's blocking (32-column groups; bf16 also 32-wide input slices on AMX, input
    pairs on AVX-512), or a dtype no kernel takes: None, and Linear keeps its own path."""
    w = torch.randn(*shape).to(dtype)
    assert prepack_linear(w) is None
    layer = Linear(w, prepack=prepack_linear)
    assert layer.kernel is None
    x = torch.randn(4, shape[1]).to(dtype)
    torch.testing.assert_close(layer(x).float(), oracle(x, w, None), rtol=1e-2, atol=5e-2)


def test_packed_shape_is_checked():
    ext = load_extension()
    if not ext.amx_linear_available():
        pytest.skip("this CPU has no AMX bf16")
    packed = ext.amx_pack_weight(bf16(64, 64, seed=8))
    with pytest.raises(RuntimeError, match="packed must be"):
        ext.amx_linear(bf16(2, 64, seed=9), packed, None, 32)
    with pytest.raises(RuntimeError, match="multiple of"):
        ext.amx_pack_weight(bf16(40, 64, seed=10))


@needs_amx
def test_packed_rows_are_the_weight_rows():
    """A tied embedding's lookup reads the packed LM head back: exactly weight[ids], any order."""
    w = bf16(96, 64, seed=11)
    linear = prepack_linear(w)
    ids = torch.tensor([95, 0, 31, 32, 33, 47, 48, 63, 64, 0, 95])  # group and tile edges, repeats
    assert torch.equal(linear.rows(ids), w[ids])
    assert linear.rows(torch.empty(0, dtype=torch.long)).shape == (0, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        linear.rows(torch.tensor([96]))
    with pytest.raises(RuntimeError, match="int64"):
        linear.rows(torch.tensor([1], dtype=torch.int32))
