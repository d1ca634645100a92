"""fp32 linear layers on AMX (kernels/cpu/amx_fp32_linear.cpp): each fp32 value split into three
bf16 terms and six of their products summed by the tile unit in fp32. Judged against the exact
product (float64) alone: every output within the bound of a plain fp32 sum of every product in
turn plus the three small products left out (tests/kernels/linear_oracle.py), and over many
outputs as close to the exact value as simd_linear.cpp's fp32 FMAs are, within a factor two, on
the same data (a term dropped by mistake, hi.mid say, is off by 2^-9 of a product: thousands of
times that). fp32_linear hands rows from fp32_amx_min_rows() on to this kernel where AMX runs.
Runs where the CPU has AMX; elsewhere fp32_linear keeps its FMAs (test_simd_linear.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import AVX512_FP32, amx_available, avx512_available, packed_linear

from tests.kernels.linear_oracle import assert_fp32_accurate, assert_fp32_split_accurate, exact

needs_amx = pytest.mark.skipif(not (amx_available() and avx512_available()), reason="this CPU has no AMX bf16")
pytestmark = needs_amx


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ext():
    return load_extension()


# Rows: 32-row blocks (1, 31-33), chunks of row blocks (300, 700 at K = 1536: six chunks of four
# blocks, the last short). in_features: padded to slices of 32 (7, 33, 578), one slice, many.
@pytest.mark.parametrize("rows", [1, 31, 32, 33, 128, 300])
@pytest.mark.parametrize("out_features,in_features", [(32, 7), (96, 64), (64, 578), (32, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_fp32_linear_matches_float64_matmul(ext, rows, out_features, in_features, with_bias):
    w, x = randn(out_features, in_features, seed=1), randn(rows, in_features, seed=2)
    bias = randn(out_features, seed=3) if with_bias else None
    got = ext.fp32_amx_linear(x, ext.fp32_pack_weight(w), bias, out_features)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert_fp32_split_accurate(got, x, w, bias)


def test_long_chunked_call_spans_every_chunk_and_panel(ext):
    """700 rows at K = 1536 (six chunks of four 32-row blocks) over 48 panels, both threads."""
    w, x = randn(1536, 1536, seed=4) * 0.03, randn(700, 1536, seed=5)
    got = ext.fp32_amx_linear(x, ext.fp32_pack_weight(w), None, 1536)
    assert_fp32_split_accurate(got, x, w, None)


@pytest.mark.parametrize("in_features", [64, 576, 1536])
def test_as_accurate_as_the_fma_kernel(ext, in_features):
    """Root-mean-square error against the exact product within twice that of simd_linear.cpp's
    fp32 FMAs (blocked sums, the tighter of the two) on the same values: the split loses nothing
    that matters. 127 rows keep fp32_linear on its FMAs."""
    w, x = randn(256, in_features, seed=6) * 0.05, randn(127, in_features, seed=7)
    packed, want = ext.fp32_pack_weight(w), exact(x, w, None)
    assert 127 < ext.fp32_amx_min_rows()
    fma, amx = ext.fp32_linear(x, packed, None, 256), ext.fp32_amx_linear(x, packed, None, 256)
    fma_err = (fma.double() - want).pow(2).mean().sqrt()
    amx_err = (amx.double() - want).pow(2).mean().sqrt()
    assert amx_err <= 2 * fma_err, f"{amx_err:.3g} vs the FMA kernel's {fma_err:.3g}"


def test_values_with_every_bit_of_their_significand(ext):
    """Inputs and weights whose 24 significant bits are all set, at mixed scales: each needs all
    three bf16 terms, so a term lost shows at once."""
    g = torch.Generator().manual_seed(8)
    def full(*shape):
        scale = torch.pow(2.0, torch.randint(-20, 20, shape, generator=g).float())
        sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
        return (sign * scale * (2 - 2.0**-23)).float()
    w, x = full(64, 96), full(40, 96)
    assert_fp32_split_accurate(ext.fp32_amx_linear(x, ext.fp32_pack_weight(w), None, 64), x, w, None)


def test_non_finite_inputs_give_what_the_exact_product_gives(ext):
    w, x = randn(64, 40, seed=15), randn(4, 40, seed=16)
    w[3] = w[3].abs()  # column 3 sums an infinity without cancelling it
    x[0, 5], x[1, 7], x[2, 9] = float("nan"), float("inf"), -float("inf")
    got, want = ext.fp32_amx_linear(x, ext.fp32_pack_weight(w), None, 64).double(), exact(x, w, None)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isposinf(), want.isposinf())
    assert torch.equal(got.isneginf(), want.isneginf()) and got[1, 3] == float("inf")
    assert torch.isfinite(got[3]).all()


def test_fp32_linear_takes_amx_from_the_threshold_on(ext):
    """fp32_linear (what prepack_linear's fp32 layers call) gives fp32_amx_linear's bits from
    fp32_amx_min_rows() rows on, and its FMAs' below (bits that differ from the AMX kernel's)."""
    rows = ext.fp32_amx_min_rows()
    w, x = randn(96, 576, seed=9), randn(rows + 5, 576, seed=10)
    layer = packed_linear(AVX512_FP32, w)
    amx = ext.fp32_amx_linear(x, layer.packed, None, 96)
    assert torch.equal(layer(x, None), amx)
    assert torch.equal(layer(x[:rows], None), amx[:rows])
    below = layer(x[: rows - 1], None)
    assert not torch.equal(below, amx[: rows - 1])
    assert_fp32_accurate(below, x[: rows - 1], w, None)


def test_out_is_written_and_bad_arguments_are_refused(ext):
    w, x = randn(64, 48, seed=11), randn(200, 48, seed=12)
    packed = ext.fp32_pack_weight(w)
    out = torch.full((200, 64), float("nan"))
    got = ext.fp32_amx_linear(x, packed, None, 64, out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, ext.fp32_amx_linear(x, packed, None, 64))
    assert ext.fp32_amx_linear(torch.empty(0, 48), packed, None, 64).shape == (0, 64)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D float32"):
        ext.fp32_amx_linear(x.bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="packed must be fp32_pack_weight's result"):
        ext.fp32_amx_linear(x, packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        ext.fp32_amx_linear(x, packed, torch.zeros(32), 64)


def test_shared_with_the_helper_thread_gives_the_same_bits(ext):
    """At one OpenMP thread with work_share's helper on (tests/kernels/test_work_share.py), the
    AMX path's panels computed by either thread give the bits of the unshared call."""
    from tests.kernels.test_work_share import share_until_the_helper_takes_part
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w, x = randn(4096, 128, seed=13), randn(ext.fp32_amx_min_rows() + 40, 128, seed=14)
        packed = ext.fp32_pack_weight(w)
        want = ext.fp32_amx_linear(x, packed, None, 4096)
        for stall_us in (0, 300):
            share_until_the_helper_takes_part(
                ext, stall_us, lambda: torch.equal(ext.fp32_linear(x, packed, None, 4096), want) or pytest.fail(
                    "the shared call's bits differ"))
    finally:
        ext.work_share_set_helper(False, -1)
        ext.work_share_set_test_delay_us(0)
        torch.set_num_threads(before)
