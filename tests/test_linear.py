"""core/layers/linear.py: a bf16 weight packed for oneDNN (where the CPU lets it) computes what
F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.core.layers.linear import Linear, _can_pack


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(200, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    layer = Linear(weight, bias)
    # oneDNN packs bf16 where the CPU lets it (AVX-512; not on plain AVX2): then only the packed
    # copy is kept. Either way the layer computes the product.
    assert (layer.packed is not None) == _can_pack(weight)
    assert (layer.weight is None) == (layer.packed is not None)
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # Both accumulate in fp32 and round once to bf16: within one bf16 step of the fp32 result.
    torch.testing.assert_close(layer(x).float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_and_plain_fp32(dtype):
    weight = torch.randn(10, 4).to(dtype)
    layer = Linear(weight)
    assert layer(torch.empty(0, 4, dtype=dtype)).shape == (0, 10)
    if dtype == torch.float32:
        assert layer.packed is None and layer.weight is weight  # fp32 stays a plain F.linear
        x = torch.randn(3, 4)
        assert torch.equal(layer(x), F.linear(x, weight))


def test_unpacked_when_asked():
    weight = torch.randn(10, 4).to(torch.bfloat16)
    layer = Linear(weight, pack=False)
    assert layer.packed is None and torch.equal(layer(torch.ones(2, 4, dtype=torch.bfloat16)),
                                                F.linear(torch.ones(2, 4, dtype=torch.bfloat16), weight))
