"""Weight-only int8 linear layers: the torch reference (kernels/reference/int8_linear.py) and the
C++ kernels (kernels/cpu/int8_linear.cpp) against it.

The reference is checked against its definition (codes and scales that reproduce the weight within
half a step). Each kernel's output must be the exact product of x and the dequantized weight
(q * scale, exact in float64) within the bound of a blocked fp32 sum (tests/kernels/linear_oracle.py:
the kernels sum groups of 32 or blocks of 128 k, then scale and add them), rounded once for bf16.
Every kernel this CPU runs is tested, whichever it would choose: int8_dot_linear (vdpbf16ps with
AVX512-BF16, else its emulation) on any AVX-512 CPU, int8_avx2_linear on any AVX2 one; under
`bash scripts/test_as_host.sh avx2` only the AVX2 kernel runs, as on a CPU without AVX-512.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.layers.linear import Linear
from pagedserve.kernels.cpu import int8_linear as cpu_int8
from pagedserve.kernels.cpu import isa
from pagedserve.kernels.reference.int8_linear import (Int8Weight, from_q8_0, int8_linear, quantize_per_channel,
                                                      reference_int8_linear)

from tests.kernels.linear_oracle import assert_bf16_rounded_once, assert_fp32_accurate

RUNNABLE = cpu_int8.runnable_kernels()
needs = {k: pytest.mark.skipif(k not in RUNNABLE, reason=f"this CPU (or PAGEDSERVE_CPU_ISA) does not run {k}")
         for k in (cpu_int8.DOT, cpu_int8.AVX2, cpu_int8.AMX)}
KERNELS = [pytest.param(cpu_int8.DOT, torch.bfloat16, marks=needs[cpu_int8.DOT], id="dot-bf16"),
           pytest.param(cpu_int8.AMX, torch.bfloat16, marks=needs[cpu_int8.AMX], id="amx-bf16"),
           pytest.param(cpu_int8.AVX2, torch.bfloat16, marks=needs[cpu_int8.AVX2], id="avx2-bf16"),
           pytest.param(cpu_int8.AVX2, torch.float32, marks=needs[cpu_int8.AVX2], id="avx2-fp32")]


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def q8_0_weight(out_features: int, in_features: int, seed: int) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = (torch.rand(out_features, in_features // 32, generator=g) * 0.02 + 1e-3).half()
    return from_q8_0(codes, scales)


# --- the reference -------------------------------------------------------------------------------

def test_per_channel_codes_reproduce_the_weight():
    w = randn(48, 70, seed=1) * torch.linspace(0.01, 5, 48)[:, None]
    w[3] = 0.0  # an all-zero row
    q = quantize_per_channel(w)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (1, 48) and q.group_size == 70
    assert int(q.qweight.abs().max()) == 127 and (q.qweight[3] == 0).all()
    step = q.scales[0][:, None]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7 * w.abs()).all()
    # Each row's largest magnitude is a full-scale code: the scale is that row's max / 127.
    torch.testing.assert_close(q.scales[0][torch.arange(48) != 3], w.abs().amax(1)[torch.arange(48) != 3] / 127)


def test_q8_0_blocks_keep_their_scales():
    q = q8_0_weight(4, 64, seed=2)
    assert q.group_size == 32 and q.scales.shape == (2, 4)
    want = q.qweight.float().view(4, 2, 32) * q.scales.T[:, :, None]
    assert torch.equal(q.dequantize(), want.view(4, 64))
    ids = torch.tensor([3, 0, 3])
    assert torch.equal(q.rows(ids, torch.float32), want.view(4, 64)[ids])
    with pytest.raises(ValueError, match="one scale per 32"):
        from_q8_0(q.qweight, torch.ones(4, 3))


def test_reference_linear_is_the_dequantized_product():
    w, x, b = randn(40, 33, seed=3), randn(5, 33, seed=4), randn(40, seed=5)
    q = quantize_per_channel(w)
    torch.testing.assert_close(int8_linear(x, q, b), x @ q.dequantize().T + b)
    assert int8_linear(x.bfloat16(), q).dtype == torch.bfloat16


# --- the kernels against it ----------------------------------------------------------------------

# Rows: blocks of 12 (1, 5, 11-13, 24), AVX2 slices of 6 (2, 7), chunks of up to 96 (97, 130).
@pytest.mark.parametrize("kernel,dtype", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 12, 13, 24, 97, 130])
@pytest.mark.parametrize("out_features,in_features,group", [(32, 2, None), (96, 64, None), (64, 578, None),
                                                            (160, 1536, None), (64, 96, 32), (32, 1536, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_is_the_dequantized_product(kernel, dtype, rows, out_features, in_features, group, with_bias):
    # int8_amx_linear: per-column scales, in_features a multiple of 32 (rows below AMX_MIN_ROWS
    # take int8_dot_linear over the same codes); the other shapes never reach it (test below).
    if kernel == cpu_int8.AMX and (group is not None or in_features % 32):
        pytest.skip("int8_amx_linear takes per-column scales over in_features a multiple of 32")
    if group is None:
        weight = quantize_per_channel(randn(out_features, in_features, seed=1))
    else:
        weight = q8_0_weight(out_features, in_features, seed=1)
    x = randn(rows, in_features, seed=2, dtype=dtype)
    bias = randn(out_features, seed=3, dtype=dtype) if with_bias else None
    linear = cpu_int8.packed_int8_linear(kernel, weight, dtype)
    assert linear.packed.dtype == torch.int8 and linear.packed.numel() == out_features * in_features
    got = linear(x, bias)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    w = weight.dequantize(torch.float64)
    if dtype == torch.float32:
        assert_fp32_accurate(got, x, w, bias)
    else:  # an AMX tile accumulator adds every pair of k in turn, not blocks of 128
        assert_bf16_rounded_once(got, x, w, bias, in_features + 1 if kernel == cpu_int8.AMX else None)


@pytest.mark.parametrize("kernel,dtype", KERNELS)
def test_zero_rows_and_tied_embedding_rows(kernel, dtype):
    weight = quantize_per_channel(randn(96, 64, seed=6))
    linear = cpu_int8.packed_int8_linear(kernel, weight, dtype)
    assert linear(torch.empty(0, 64, dtype=dtype), None).shape == (0, 96)
    ids = torch.tensor([0, 95, 31, 32, 31])
    assert torch.equal(linear.rows(ids), weight.rows(ids, dtype))


@needs[cpu_int8.AMX]
def test_amx_kernel_takes_per_column_scales_from_its_row_count_on():
    """bf16 per-column int8 weights take int8_amx_linear on AMX from AMX_MIN_ROWS rows on; grouped
    (Q8_0) scales or in_features off its 32 keep int8_dot_linear; the kernel refuses them itself."""
    ext = cpu_int8.load_extension()
    layer = cpu_int8.prepack_int8_linear(quantize_per_channel(randn(96, 64, seed=11)), torch.bfloat16)
    assert layer.kernel == cpu_int8.AMX
    assert cpu_int8.prepack_int8_linear(q8_0_weight(64, 96, seed=12), torch.bfloat16).kernel == cpu_int8.DOT
    assert cpu_int8.prepack_int8_linear(quantize_per_channel(randn(64, 578, seed=13)), torch.bfloat16).kernel == \
        cpu_int8.DOT
    q = q8_0_weight(64, 96, seed=12)
    with pytest.raises(RuntimeError, match="one scale per output column"):
        ext.int8_amx_linear(randn(8, 96, seed=14, dtype=torch.bfloat16), ext.int8_pack_weight(q.qweight),
                            q.scales.contiguous(), None, 64, 32)
    calls = []
    real = {name: getattr(ext, name) for name in (cpu_int8.AMX, cpu_int8.DOT)}
    for name in real:
        setattr(ext, name, lambda *a, _n=name: calls.append(_n) or real[_n](*a))
    try:
        layer = cpu_int8.prepack_int8_linear(quantize_per_channel(randn(96, 64, seed=11)), torch.bfloat16)
        for rows in (1, cpu_int8.AMX_MIN_ROWS - 1, cpu_int8.AMX_MIN_ROWS, 64):
            layer(randn(rows, 64, seed=15, dtype=torch.bfloat16), None)
    finally:
        for name, fn in real.items():
            setattr(ext, name, fn)
    assert calls == [cpu_int8.DOT, cpu_int8.DOT, cpu_int8.AMX, cpu_int8.AMX]


def test_kernel_choice():
    """bf16 activations take the vdpbf16ps kernel where bf16 is native, else AVX2's fp32 math; fp32
    activations always AVX2's; a shape off the panels, or odd in_features, keeps the reference."""
    native = isa.native_bf16() and cpu_int8.DOT in RUNNABLE
    avx2 = cpu_int8.AVX2 if cpu_int8.AVX2 in RUNNABLE else None
    assert cpu_int8.kernel_for(torch.bfloat16) == (cpu_int8.DOT if native else avx2)
    assert cpu_int8.kernel_for(torch.float32) == avx2
    assert cpu_int8.kernel_for(torch.float16) is None
    for shape in ((33, 64), (64, 33)):
        assert cpu_int8.prepack_int8_linear(quantize_per_channel(randn(*shape, seed=7)), torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (33, 17)])
def test_linear_layer_int8(dtype, shape):
    """Linear(int8=True): the kernel where one takes the shape, else the reference; the float weight
    is not kept; an Int8Weight (GGUF Q8_0) is taken as it is."""
    w = randn(*shape, seed=8, dtype=dtype)
    x = randn(6, shape[1], seed=9, dtype=dtype)
    layer = Linear(w, int8=True, prepack_int8=cpu_int8.prepack_int8_linear)
    assert layer.weight is None and layer.packed is None and (layer.out_features, layer.in_features) == shape
    want = int8_linear(x, quantize_per_channel(w))
    torch.testing.assert_close(layer(x), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    on_kernel = cpu_int8.kernel_for(dtype) is not None and shape == (96, 64)
    assert hasattr(layer.kernel, "packed") == on_kernel
    plain = Linear(w, int8=True)  # no backend packing: the reference
    assert torch.equal(plain(x), want)
    q = q8_0_weight(64, 64, seed=10)
    gguf_layer = Linear(q, prepack_int8=cpu_int8.prepack_int8_linear, dtype=dtype)
    torch.testing.assert_close(gguf_layer(x[:, :1].expand(6, 64).contiguous()),
                               int8_linear(x[:, :1].expand(6, 64).contiguous(), q), rtol=1e-2, atol=1e-3)


def test_reference_function_reads_embedding_rows():
    q = quantize_per_channel(randn(10, 8, seed=11))
    f = reference_int8_linear(q, torch.bfloat16)
    assert torch.equal(f.rows(torch.tensor([2, 9])), q.dequantize(torch.bfloat16)[[2, 9]])
