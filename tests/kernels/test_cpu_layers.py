"""The fused C++ decoder-layer ops (kernels/cpu/fused_ops.cpp) against the pure-torch reference
(kernels/reference/layers.py), which tests/test_engine_vs_transformers.py ties to Hugging Face.

fp32 results agree to rounding; bf16 results may differ by one bf16 rounding step where the
fused op sums in another order (the norm's fp32 sum) or rounds once instead of twice."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu, reference
from pagedserve.kernels.cpu.build import load_extension

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DTYPES = [torch.float32, torch.bfloat16]
# fp32: rounding only. bf16: 8 mantissa bits, so one rounding step is 2^-8 relative.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture(autouse=True)
def _built():
    load_extension()


def rows(n: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, width, generator=g) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,width", [(1, 576), (7, 64), (130, 960), (3, 83), (0, 64)])
def test_rms_norm(dtype, n, width):
    x, weight = rows(n, width, dtype), rows(1, width, dtype, seed=1)[0]
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,width", [(1, 576), (33, 960), (3, 83), (0, 64)])
def test_add_rms_norm_in_place(dtype, n, width):
    x, residual, weight = rows(n, width, dtype), rows(n, width, dtype, seed=2), rows(1, width, dtype, seed=3)[0]
    want_normed, want_sum = reference.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    normed, summed = cpu.add_rms_norm(x, residual, weight, 1e-6)
    # In place: the caller's buffers are the results (the model relies on it to skip allocations).
    if n:
        assert normed.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)  # one add, one rounding: exact
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 1536), (17, 48), (64, 2560), (5, 53), (0, 16)])
def test_silu_and_mul(dtype, n, inter):
    gate_up = rows(n, 2 * inter, dtype)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 2048), (17, 48), (64, 640), (5, 53), (0, 16)])
def test_gelu_tanh_and_mul(dtype, n, inter):
    """Gemma's MLP activation against torch's tanh GELU, over gates out to +-40 (saturated: the
    kernel's form g / (1 + e^-z) must give g and a zero of g's sign there, never NaN)."""
    gate_up = rows(n, 2 * inter, dtype)
    if n:
        gate_up[0, : min(inter, 6)] = torch.tensor([-40.0, -9.0, -3.5, 0.0, 7.5, 40.0])[: min(inter, 6)].to(dtype)
    got = cpu.gelu_tanh_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == (n, inter)
    torch.testing.assert_close(got, reference.gelu_tanh_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("n,inter", [(1, 1536), (17, 48), (5, 53), (3, 7), (0, 16)])
def test_fp32_silu_and_mul_of_the_avx2_build(n, inter):
    """What CPUs with AVX2 but no AVX-512 run (8 lanes at a time, then one): the reference's result,
    gates beyond exp's clamp at +-88 included, and the same values as the AVX-512 / baseline build
    for infinities and NaN too (the same operations on every value)."""
    ext = load_extension()
    if not ext.avx2_kernels_available():
        pytest.skip("this CPU has no AVX2 with FMA")
    finite = rows(n, 2 * inter, torch.float32) * 30
    special = finite.clone()
    if n:
        special[0, :4] = torch.tensor([float("-inf"), float("inf"), float("nan"), -100.0])
    before = ext.force_avx2_vector_code(True)
    try:
        got, got_special = cpu.silu_and_mul(finite), cpu.silu_and_mul(special)
    finally:
        ext.force_avx2_vector_code(before)
    torch.testing.assert_close(got, reference.silu_and_mul(finite), **TOL[torch.float32])
    torch.testing.assert_close(got_special, cpu.silu_and_mul(special), rtol=0, atol=0, equal_nan=True)


def rotary_tables(max_pos: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 16), (2, 1, 96)])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_rotary_qkv(dtype, heads, kv_heads, head_dim, qk_norm):
    n = 11
    qkv = rows(n, (heads + 2 * kv_heads) * head_dim, dtype)
    positions = torch.tensor([0, 1, 2, 3, 50, 51, 7, 300, 301, 302, 511])
    cos, sin = rotary_tables(512, head_dim, dtype)
    norms = (rows(1, head_dim, dtype, 4)[0], rows(1, head_dim, dtype, 5)[0]) if qk_norm else (None, None)
    got = cpu.rotary_qkv(qkv, positions, cos, sin, heads, kv_heads, *norms, eps=1e-6)
    want = reference.rotary_qkv(qkv, positions, cos, sin, heads, kv_heads, *norms, eps=1e-6)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, **TOL[dtype], msg=lambda m: f"{name}: {m}")
    assert torch.equal(got[2], want[2])  # v is copied, never rounded


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_store_kv_writes_each_slot_once(cache_dtype, kv_dtype):
    """The C++ store (fp32/bf16 caches) against the reference store, including fp32 -> bf16."""
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 64
    key, value = rows(20, kv_heads * head_dim, kv_dtype, 6), rows(20, kv_heads * head_dim, kv_dtype, 7)
    key, value = key.view(20, kv_heads, head_dim), value.view(20, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(8))[:20]
    caches = [torch.full((num_blocks, block_size, kv_heads, head_dim), -7.0, dtype=cache_dtype) for _ in range(4)]
    cpu.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (caches[0].view(-1, kv_heads, head_dim)[untouched] == -7.0).all()


@pytest.mark.parametrize("bad", [-1, 512])
def test_rotary_qkv_refuses_a_position_outside_the_table(bad):
    """Every position is checked (a plain loop over the rows, not only its ends), before anything
    is read from the table."""
    ext = load_extension()
    qkv = rows(5, (9 + 2 * 3) * 64, torch.float32)
    cos, sin = rotary_tables(512, 64, torch.float32)
    assert ext.rotary_qkv(qkv, torch.tensor([0, 3, 511, 2, 1]), cos, sin, 9, 3, None, None, 1e-6)[0].shape == (5, 9, 64)
    with pytest.raises(RuntimeError, match="a position is outside the cos/sin table"):
        ext.rotary_qkv(qkv, torch.tensor([0, 3, bad, 2, 1]), cos, sin, 9, 3, None, None, 1e-6)


@pytest.mark.parametrize("bad", [-1, 6 * 16])
def test_store_kv_refuses_a_slot_outside_the_cache(bad):
    ext = load_extension()
    key = rows(4, 3 * 64, torch.float32, 6).view(4, 3, 64)
    caches = [torch.full((6, 16, 3, 64), -7.0) for _ in range(2)]
    with pytest.raises(RuntimeError, match="a slot is outside the cache"):
        ext.store_kv(key, key, *caches, torch.tensor([5, bad, 7, 8]))
    assert (caches[0] == -7.0).all() and (caches[1] == -7.0).all()  # refused before any write
