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


# amx_gated_linear: a gate_up projection and its gated activation in one pass. The oracle is the
# two-pass path it replaces, the projection (checked above against the exact product) then the
# C++ silu_and_mul / gelu_tanh_and_mul (checked against torch in test_cpu_layers.py): the same
# bits, NaN and infinities included.
@needs_amx
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64, 100, 512])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (192, 64), (3072, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_linear_is_the_activation_over_the_projection(activation, rows, out_features, in_features, with_bias):
    ext = load_extension()
    w, x = bf16(out_features, in_features, seed=11) * 0.3, bf16(rows, in_features, seed=12)
    if rows > 3:
        x[1, 2], x[2, 0], x[3, 5] = float("nan"), float("inf"), -float("inf")
    bias = bf16(out_features, seed=13) if with_bias else None
    linear = prepack_linear(w)
    act_and_mul = ext.silu_and_mul if activation == "silu" else ext.gelu_tanh_and_mul
    got = linear.gated(x, bias, activation)
    want = act_and_mul(linear(x, bias))
    assert got.shape == (rows, out_features // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    layer = Linear(w, bias, prepack=prepack_linear)
    assert torch.equal(layer.act_and_mul(x, activation, act_and_mul).view(torch.int16), want.view(torch.int16))


@needs_amx
def test_gated_linear_checks_its_arguments():
    ext = load_extension()
    w = bf16(96, 32, seed=14)
    packed = ext.amx_pack_weight(w)
    x = bf16(3, 32, seed=15)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.amx_gated_linear(x, packed, None, 96, "silu")  # 48 gate columns: not whole 32-column groups
    assert not hasattr(prepack_linear(w), "gated")
    packed = ext.amx_pack_weight(bf16(128, 32, seed=16))
    with pytest.raises(RuntimeError, match="'silu' or 'gelu_tanh', got 'relu'"):
        ext.amx_gated_linear(x, packed, None, 128, "relu")
    assert ext.amx_gated_linear(x[:0], packed, None, 128, "silu").shape == (0, 64)


def test_act_and_mul_falls_back_where_the_kernel_has_no_gated_epilogue():
    """torch's matmul (here), the other packed kernels and int8 compute the projection and call
    the given act_and_mul."""
    w, x = bf16(64, 24, seed=17), bf16(5, 24, seed=18)
    layer = Linear(w, pack=False)
    seen = []
    got = layer.act_and_mul(x, "silu", lambda gate_up: seen.append(gate_up.shape) or gate_up[:, :32] * 2)
    assert seen == [(5, 64)] and torch.equal(got, layer(x)[:, :32] * 2)
