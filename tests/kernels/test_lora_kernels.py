"""lora_add: the reference against a loop over rows (the definition), and the C++ kernel against the
reference, for mixed slots, base rows (-1), one slot on every row, a subset of the slots, fused
projections (block-diagonal B) and both dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.reference.lora import check_lora_args, lora_add, make_slot_groups

L, R = 4, 8


def case(rows: int, slots: list[int], out_slices: tuple[int, ...], n_in: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    parts = len(out_slices) - 1
    out = out_slices[-1]
    a = torch.randn(L, parts * R, n_in, generator=g)
    b = torch.zeros(L, parts * R, out)
    for p in range(parts):  # block diagonal, as core/lora/slots.py fills it
        b[:, p * R:(p + 1) * R, out_slices[p]:out_slices[p + 1]] = torch.randn(L, R, out_slices[p + 1] - out_slices[p],
                                                                                generator=g)
    x = torch.randn(rows, n_in, generator=g)
    y = torch.randn(rows, out, generator=g)
    token_slots = torch.tensor([slots[i % len(slots)] for i in range(rows)], dtype=torch.int32)
    return [t.to(dtype) for t in (y, x, a, b)] + [token_slots]


def by_rows(y, x, a, b, token_slots):
    """The definition, one row at a time, in fp64."""
    expect = y.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            expect[t] += (x[t].double() @ a[s].double().T) @ b[s].double()
    return expect


SHAPES = [((0, 48), 32), ((0, 32, 48, 64), 48), ((0, 40, 80), 24)]  # o-like, qkv-like, gate_up-like
SLOT_MIXES = [[0, 1, -1, 2, 3, 1], [2], [3, -1], [1, 3, 1, 1, -1]]


def groups_of(token_slots):
    present = tuple(sorted(set(token_slots.tolist()) - {-1}))
    return make_slot_groups(token_slots, present, L, torch.float32)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slots", SLOT_MIXES)
def test_reference_equals_the_definition(rows, shape, slots):
    out_slices, n_in = shape
    y, x, a, b, token_slots = case(rows, slots, out_slices, n_in, torch.float32)
    check_lora_args(y, x, a, b, token_slots)
    expect = by_rows(y, x, a, b, token_slots)
    groups = groups_of(token_slots)
    lora_add(y, x, a, b, token_slots, groups, out_slices)
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-4)
    untouched = token_slots == -1
    assert torch.equal(y[untouched].double(), expect[untouched])  # base rows exactly as they were


def _cpu_kernel():
    try:
        from pagedserve.kernels.cpu import lora as cpu_lora
    except ImportError:  # noqa: PERF203
        pytest.fail("pagedserve.kernels.cpu.lora is missing")
    if not cpu_lora.native_available():
        pytest.skip("the C++ lora_add needs AVX-512 (this CPU takes the reference)")
    return cpu_lora


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slots", SLOT_MIXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_the_reference(rows, shape, slots, dtype):
    cpu_lora = _cpu_kernel()
    out_slices, n_in = shape
    y, x, a, b, token_slots = case(rows, slots, out_slices, n_in, dtype, seed=rows)
    expect = y.clone()
    lora_add(expect, x, a, b, token_slots, groups_of(token_slots), out_slices)
    cpu_lora.lora_add(y, x, a, b, token_slots, groups_of(token_slots), out_slices)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-4)
    else:  # the reference rounds its shrink to bf16 before the expand; C++ keeps it fp32
        torch.testing.assert_close(y.float(), expect.float(), rtol=2e-2, atol=0.25)
    assert torch.equal(y[token_slots == -1], expect[token_slots == -1])


@pytest.mark.parametrize("native", [True, False])
def test_cpu_wrapper_needs_no_groups(monkeypatch, native):
    """The runner passes groups=None where the C++ kernel runs; the wrapper's fallback (no AVX-512)
    builds them itself."""
    from pagedserve.kernels.cpu import lora as cpu_lora

    if native and not cpu_lora.native_available():
        pytest.skip("the C++ lora_add needs AVX-512")
    monkeypatch.setattr(cpu_lora, "native_available", lambda: native)
    y, x, a, b, token_slots = case(9, SLOT_MIXES[0], (0, 32, 48, 64), 48, torch.float32, seed=3)
    expect = by_rows(y, x, a, b, token_slots)
    cpu_lora.lora_add(y, x, a, b, token_slots, None, (0, 32, 48, 64))
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-4)
    assert cpu_lora.lora_needs_groups() is not native
