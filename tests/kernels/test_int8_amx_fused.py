"""int8_amx_linear's fused forms (kernels/cpu/amx_int8_linear.cpp): the LM head's greedy argmax
(int8_amx_linear_argmax) and a gate_up projection's gated activation (int8_amx_gated_linear), each
against the unfused path it replaces over the same kernel: argmax_rows over int8_amx_linear's
stored result (torch's max(dim=-1).indices rule: the first of equal maxima, a row's first NaN), and
the C++ silu_and_mul / gelu_tanh_and_mul over it, bit for bit. int8_amx_linear itself is checked
against the exact dequantized product in test_int8_linear.py. Linear uses the fused forms from
AMX_MIN_ROWS rows on; fewer rows take int8_dot_linear and the unfused path."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.layers.linear import Linear
from pagedserve.kernels.cpu import int8_linear as cpu_int8
from pagedserve.kernels.reference.int8_linear import quantize_per_channel
from pagedserve.kernels.reference.sampling import argmax_rows

pytestmark = pytest.mark.skipif(cpu_int8.AMX not in cpu_int8.runnable_kernels(),
                                reason="this CPU (or PAGEDSERVE_CPU_ISA) does not run int8_amx_linear")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def amx_layer(w: torch.Tensor):
    return cpu_int8.packed_int8_linear(cpu_int8.AMX, quantize_per_channel(w), torch.bfloat16)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [4, 7, 16, 17, 33, 64, 100, 512])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (192, 64), (3072, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_is_the_activation_over_the_projection(activation, rows, out_features, in_features, with_bias):
    ext = cpu_int8.load_extension()
    x = randn(rows, in_features, seed=12, dtype=torch.bfloat16)
    x[1, 2], x[2, 0], x[3, 5] = float("nan"), float("inf"), -float("inf")
    bias = randn(out_features, seed=13, dtype=torch.bfloat16) if with_bias else None
    layer = amx_layer(randn(out_features, in_features, seed=11) * 0.3)
    act_and_mul = ext.silu_and_mul if activation == "silu" else ext.gelu_tanh_and_mul
    got = layer.gated(x, bias, activation)
    want = act_and_mul(layer(x, bias))
    assert got.shape == (rows, out_features // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows", [4, 13, 33, 64, 97, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_argmax_is_the_stored_results_argmax(rows, with_bias, threads):
    """Columns 1024 on repeat columns 0-1023 (the same codes and scales) and column 7 repeats
    column 3: every row's maximum is tied, across the two threads' halves too, and the first wins."""
    w = randn(2048, 64, seed=1)
    w[7] = w[3]
    w[1024:] = w[:1024]
    x = randn(rows, 64, seed=2, dtype=torch.bfloat16)
    bias = randn(1024, seed=3, dtype=torch.bfloat16).repeat(2) if with_bias else None
    layer = amx_layer(w)
    got = layer.argmax(x, bias)
    want = argmax_rows(layer(x, bias).float())
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert (want < 1024).all()


def test_argmax_non_finite_rows(threads):
    """A NaN input row: its first column. An +inf input: the first column that gets +inf."""
    w, x = randn(2048, 32, seed=4), randn(5, 32, seed=5, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    x[2, 4] = float("inf")
    layer = amx_layer(w)
    got = layer.argmax(x, None)
    assert torch.equal(got, argmax_rows(layer(x, None).float()))
    assert got[0] == 0


def test_linear_takes_the_fused_forms_from_amx_min_rows_on():
    """Linear.argmax / act_and_mul: fewer than AMX_MIN_ROWS rows compute the projection with
    int8_dot_linear and call the given function; from AMX_MIN_ROWS on the fused kernel, which never
    calls it. The tokens and activations agree either way (within the kernels' own rounding: the
    two kernels sum in different orders, so the fused path is compared with its own projection)."""
    ext = cpu_int8.load_extension()
    w = randn(128, 64, seed=7)
    layer = Linear(w, int8=True, dtype=torch.bfloat16, prepack_int8=cpu_int8.prepack_int8_linear)
    assert layer.kernel.kernel == cpu_int8.AMX and layer.kernel.fused_min_rows == cpu_int8.AMX_MIN_ROWS
    for rows in (1, cpu_int8.AMX_MIN_ROWS - 1, cpu_int8.AMX_MIN_ROWS, 40):
        x = randn(rows, 64, seed=8 + rows, dtype=torch.bfloat16)
        seen = []
        tokens = layer.argmax(x, lambda logits: seen.append("argmax") or argmax_rows(logits))
        gated = layer.act_and_mul(x, "silu", lambda gate_up: seen.append("gated") or ext.silu_and_mul(gate_up))
        assert seen == ([] if rows >= cpu_int8.AMX_MIN_ROWS else ["argmax", "gated"])
        assert torch.equal(tokens, argmax_rows(layer(x).float()))
        assert torch.equal(gated.view(torch.int16), ext.silu_and_mul(layer(x)).view(torch.int16))


def test_arguments_are_checked():
    ext = cpu_int8.load_extension()
    q = quantize_per_channel(randn(96, 32, seed=14))
    packed, scales = ext.int8_pack_weight(q.qweight), q.scales.contiguous()
    x = randn(5, 32, seed=15, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.int8_amx_gated_linear(x, packed, scales, None, 96, "silu")  # 48 gate columns: not whole panels
    assert not hasattr(amx_layer(randn(96, 32, seed=14)), "gated")
    q = quantize_per_channel(randn(128, 32, seed=16))
    packed, scales = ext.int8_pack_weight(q.qweight), q.scales.contiguous()
    with pytest.raises(RuntimeError, match="'silu' or 'gelu_tanh', got 'relu'"):
        ext.int8_amx_gated_linear(x, packed, scales, None, 128, "relu")
    with pytest.raises(RuntimeError, match="int8_amx_linear_argmax: x must be"):
        ext.int8_amx_linear_argmax(x.float(), packed, scales, None, 128)
    with pytest.raises(RuntimeError, match="int8_amx_linear_argmax: bias must be"):
        ext.int8_amx_linear_argmax(x, packed, scales, torch.zeros(127, dtype=torch.bfloat16), 128)
    with pytest.raises(RuntimeError, match="one scale per output column"):
        ext.int8_amx_linear_argmax(x, packed, torch.ones(2, 128), None, 128)
    assert ext.int8_amx_gated_linear(x[:0], packed, scales, None, 128, "silu").shape == (0, 64)
    assert ext.int8_amx_linear_argmax(x[:0], packed, scales, None, 128).shape == (0,)
