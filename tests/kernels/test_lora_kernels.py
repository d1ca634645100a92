"""lora_add: the reference against a loop over rows (the definition), and the C++ kernel against the
reference, for mixed slots, base rows (-1), one slot on every row, a subset of the slots, fused
projections (block-diagonal B) and both dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.reference.lora import check_lora_args, lora_add, make_slot_groups

L, R = 4, 8


def case(rows: int, slots: list[int], out_slices: tuple[int, ...], n_in: int, dtype: torch.dtype, seed: int = 0,
         rank: int = R):
    g = torch.Generator().manual_seed(seed)
    parts = len(out_slices) - 1
    out = out_slices[-1]
    a = torch.randn(L, parts * rank, n_in, generator=g)
    b = torch.zeros(L, parts * rank, out)
    for p in range(parts):  # block diagonal, as core/lora/slots.py fills it
        b[:, p * rank:(p + 1) * rank, out_slices[p]:out_slices[p + 1]] = torch.randn(L, rank, out_slices[p + 1] - out_slices[p],
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


def poison_zero_blocks(b, out_slices: tuple[int, ...], rank: int) -> None:
    """NaN in B's block-diagonal zeros (part p's ranks times another part's outputs), which a
    kernel must never read: a read shows as NaN in y."""
    parts = len(out_slices) - 1
    for p in range(parts):
        for q in range(parts):
            if q != p:
                b[:, p * rank:(p + 1) * rank, out_slices[q]:out_slices[q + 1]] = float("nan")


def assert_matches_reference(y, expect, token_slots, dtype) -> None:
    """fp32: equal up to the order of the sums. bf16: the reference rounds its shrink (and each op)
    to bf16, the kernels keep fp32 longer. Base rows (-1) exactly as they were."""
    if dtype == torch.float32:
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(y.float(), expect.float(), rtol=2e-2, atol=0.25)
    assert torch.equal(y[token_slots == -1], expect[token_slots == -1])


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
    assert_matches_reference(y, expect, token_slots, dtype)


# Shapes the bf16 AMX kernel takes (amx_lora.cpp: `in` a multiple of 32, each part's rank a
# multiple of 16), with the rank per part: outputs not a multiple of its 16-column tiles, 1-3 parts,
# ranks of one, two and one-and-a-half 32-wide slices. Elsewhere the vector kernel runs them.
AMX_SHAPES = [((0, 40), 64, 16), ((0, 64, 80, 96), 96, 16), ((0, 72, 150), 32, 32), ((0, 50), 64, 48)]


@pytest.mark.parametrize("rows", [1, 16, 17, 70, 300])
@pytest.mark.parametrize("shape", AMX_SHAPES)
@pytest.mark.parametrize("slots", SLOT_MIXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_the_reference_at_amx_shapes(rows, shape, slots, dtype):
    """More than 16 rows of one adapter span several 16-row AMX blocks; B's zero blocks are
    poisoned with NaN, so a kernel that reads them shows it."""
    cpu_lora = _cpu_kernel()
    out_slices, n_in, rank = shape
    y, x, a, b, token_slots = case(rows, slots, out_slices, n_in, dtype, seed=rows, rank=rank)
    expect = y.clone()
    lora_add(expect, x, a, b, token_slots, groups_of(token_slots), out_slices)
    poison_zero_blocks(b, out_slices, rank)
    cpu_lora.lora_add(y, x, a, b, token_slots, None, out_slices)
    assert_matches_reference(y, expect, token_slots, dtype)


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


def _triton_lora():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
    from pagedserve.kernels.triton import lora as triton_lora

    return triton_lora


TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1 (conftest)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("shape", SHAPES + [((0, 24, 40, 56), 100)])  # parts not aligned to the output blocks
@pytest.mark.parametrize("slots", SLOT_MIXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_the_reference(rows, shape, slots, dtype):
    """The GPU twin under the interpreter (or on a GPU): the same sums as the reference, base rows
    untouched, B's zero blocks never needed (they are poisoned with NaN here, so a read shows)."""
    triton_lora = _triton_lora()
    out_slices, n_in = shape
    y, x, a, b, token_slots = case(rows, slots, out_slices, n_in, dtype, seed=rows + 7)
    expect = y.clone()
    lora_add(expect, x, a, b, token_slots, groups_of(token_slots), out_slices)
    poison_zero_blocks(b, out_slices, R)
    y, x, a, b, slots_t = (t.to(TRITON_DEVICE) for t in (y, x, a, b, token_slots))
    assert triton_lora.lora_needs_groups() is False
    triton_lora.lora_add(y, x, a, b, slots_t, None, out_slices)
    assert_matches_reference(y.cpu(), expect, token_slots, dtype)


def test_triton_kernel_refuses_more_parts_than_it_reads():
    triton_lora = _triton_lora()
    y, x, a, b, token_slots = case(3, [0], (0, 8, 16, 24, 32), 16, torch.float32)
    with pytest.raises(ValueError, match="1-3 parts"):
        triton_lora.lora_add(y, x, a, b, token_slots, None, (0, 8, 16, 24, 32))
