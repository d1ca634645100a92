"""Reference paged attention vs. a dense float64 softmax(QK^T)V on the unpaged per-sequence K/V.

Paged caches are built by scattering dense K/V into randomly chosen blocks of a shared pool that
starts out full of NaN, and unused block-table entries point at random blocks: any read outside a
sequence's own tokens (padding, the tail of a partial last block, stale table entries) turns the
output into NaN and fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedserve.kernels.reference.attention as ref_attn
from pagedserve.kernels.reference import paged_attention, reshape_and_cache

# Output tolerances per dtype. Inputs are exact in every dtype (the oracle upcasts the very same
# values), so the error is fp32 accumulation plus one rounding of the output to the dtype.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}

# (context_len, q_len): a prompt in one go, a one-token prompt, decodes (partial and exactly full
# last blocks), chunked prefill after a cached prefix, a chunk longer than the prefill query tile,
# and sequences that contribute no query (with and without cached tokens).
MIXED = [(0, 37), (40, 1), (33, 0), (0, 1), (63, 1), (17, 25), (150, 1), (0, 0), (96, 160), (5, 1), (31, 2)]


def dense_attention(q, k, v, context, scale, window, softcap=None):
    """float64 oracle. q: [q_len, H, D]; k, v: [seq_len, Hkv, D] unpaged; queries start at `context`."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:  # Gemma 2: transformers' eager attention caps before the mask
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(context, context + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores.masked_fill_(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(specs, *, num_kv_heads, group, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    max_blocks = max(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, math.nan, dtype=dtype)
    value_cache = torch.full(shape, math.nan, dtype=dtype)
    # Stale entries everywhere; each sequence's own blocks are a random slice of a permuted pool.
    block_table = torch.randint(0, num_blocks, (len(specs), max_blocks), generator=gen, dtype=torch.int32)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    keys, values, queries = [], [], []
    for b, ((context, q_len), seq_len) in enumerate(zip(specs, seq_lens)):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        queries.append(torch.randn(q_len, num_kv_heads * group, head_dim, generator=gen).to(dtype))
        own = [pool.pop() for _ in range(blocks_per_seq[b])]
        block_table[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
        for i, blk in enumerate(own):
            n = min(block_size, seq_len - i * block_size)
            key_cache[blk, :n] = k[i * block_size : i * block_size + n]
            value_cache[blk, :n] = v[i * block_size : i * block_size + n]
        keys.append(k)
        values.append(v)
    q_lens = [q for _, q in specs]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(
        query=torch.cat(queries), key_cache=key_cache, value_cache=value_cache, block_table=block_table,
        query_start_loc=query_start_loc, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    ), (keys, values, queries)


def check(specs, *, num_kv_heads, group, head_dim, block_size, dtype=torch.float32, window=None, seed=0,
          softcap=None, scale=None):
    args, (keys, values, queries) = make_batch(
        specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
        dtype=dtype, seed=seed)
    scale = scale or head_dim**-0.5
    out = paged_attention(**args, scale=scale, sliding_window=window, softcap=softcap)
    assert out.shape == args["query"].shape and out.dtype == dtype
    expected = torch.cat([
        dense_attention(q, k, v, c, scale, window, softcap) for (c, _), q, k, v in zip(specs, queries, keys, values)
    ])
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    return out


@pytest.mark.parametrize("head_dim,window,softcap", [(64, None, 1.0), (64, 7, 2.0), (256, 20, None), (256, 20, 3.0)])
def test_gemma_options(head_dim, window, softcap):
    """Softcapped scores (Gemma 2), head_dim 256 with a window shorter than the prompts and a scale
    other than head_dim ** -0.5 (Gemma 3's query_pre_attn_scalar); the caps sit below this batch's
    scaled scores, so capping changes the output."""
    kw = dict(num_kv_heads=2, group=2, head_dim=head_dim, block_size=16, window=window, seed=3, scale=3 * head_dim**-0.5)
    out = check(MIXED, softcap=softcap, **kw)
    if softcap is not None:
        assert (out - check(MIXED, **kw)).abs().max() > 1e-2


@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size",
    [(2, 1, 64, 16), (1, 3, 64, 1), (3, 3, 64, 16), (2, 8, 128, 32), (1, 8, 128, 16), (4, 1, 128, 1)],
)
def test_mixed_batch_matches_dense(num_kv_heads, group, head_dim, block_size):
    check(MIXED, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_dtypes(dtype, head_dim, block_size):
    check(MIXED, num_kv_heads=2, group=3, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=1)


@pytest.mark.parametrize("window", [1, 7, 16, 50, 4096])
@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window(window, block_size):
    specs = MIXED + [(200, 150), (70, 1), (300, 1)]
    check(specs, num_kv_heads=2, group=3, head_dim=64, block_size=block_size, window=window, seed=2)


@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("budget", [1, 64, 700])
def test_decode_groups(monkeypatch, budget, window):
    """Many decodes, cut into groups of every size (including rows wider than the budget)."""
    monkeypatch.setattr(ref_attn, "_DECODE_GROUP_TOKENS", budget)
    gen = torch.Generator().manual_seed(3)
    specs = [(int(n), 1) for n in torch.randint(0, 200, (24,), generator=gen)] + [(0, 9), (12, 0)]
    check(specs, num_kv_heads=3, group=3, head_dim=64, block_size=16, window=window, seed=3)


@pytest.mark.parametrize("window", [None, 5, 40])
def test_prefill_query_tiles(monkeypatch, window):
    """Chunks after a cached prefix are split into query tiles; exercise ragged tile edges."""
    monkeypatch.setattr(ref_attn, "_PREFILL_QUERY_TILE", 7)
    specs = [(10, 45), (0, 30), (61, 3), (100, 64)]
    check(specs, num_kv_heads=2, group=2, head_dim=64, block_size=16, window=window, seed=4)


def test_only_empty_sequences():
    specs = [(0, 0), (20, 0)]
    args, _ = make_batch(specs, num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float32)
    out = paged_attention(**args, scale=0.125)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("cache_dtype,key_dtype", [(torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.float32),
                                                   (torch.float16, torch.bfloat16)])
def test_reshape_and_cache_round_trip(cache_dtype, key_dtype):
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_kv_heads, head_dim = 9, 16, 3, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    key_before, value_before = key_cache.clone(), value_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:50]
    key = torch.randn(50, num_kv_heads, head_dim, generator=gen).to(key_dtype)
    value = torch.randn(50, num_kv_heads, head_dim, generator=gen).to(key_dtype)

    reshape_and_cache(key, value, key_cache, value_cache, slots)

    for cache, before, new in ((key_cache, key_before, key), (value_cache, value_before, value)):
        flat, flat_before = cache.view(-1, num_kv_heads, head_dim), before.view(-1, num_kv_heads, head_dim)
        torch.testing.assert_close(flat[slots], new.to(cache_dtype), atol=0, rtol=0)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        torch.testing.assert_close(flat[untouched], flat_before[untouched], atol=0, rtol=0)
        # Slot arithmetic: slot = block_id * block_size + offset.
        blk, off = int(slots[0]) // block_size, int(slots[0]) % block_size
        torch.testing.assert_close(cache[blk, off], new[0].to(cache_dtype), atol=0, rtol=0)


def test_engine_flow_chunked_prefill_and_decode():
    """Step by step, as the engine does it: store this step's K/V, then attend over the cache."""
    gen = torch.Generator().manual_seed(6)
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    # Per step, tokens each sequence feeds: chunked prefill, decodes, idle (0) steps, mixed.
    schedule = [[30, 41, 0], [1, 0, 64], [45, 1, 6], [24, 1, 0], [0, 1, 1]]
    num_blocks = 40
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), math.nan)
    value_cache = torch.full_like(key_cache, math.nan)
    block_table = torch.randperm(num_blocks, generator=gen)[:24].view(3, 8).to(torch.int32)
    total = [sum(step[b] for step in schedule) for b in range(3)]
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in total]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in total]
    queries = [torch.randn(n, num_kv_heads * group, head_dim, generator=gen) for n in total]
    outputs = [[] for _ in range(3)]
    done = [0, 0, 0]
    for step in schedule:
        slot_mapping = torch.cat([
            block_table[b].long()[torch.arange(done[b], done[b] + n) // block_size] * block_size
            + torch.arange(done[b], done[b] + n) % block_size for b, n in enumerate(step)])
        key = torch.cat([keys[b][done[b]:done[b] + n] for b, n in enumerate(step)])
        value = torch.cat([values[b][done[b]:done[b] + n] for b, n in enumerate(step)])
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        for b, n in enumerate(step):
            done[b] += n
        out = paged_attention(
            torch.cat([queries[b][done[b] - n:done[b]] for b, n in enumerate(step)]),
            key_cache, value_cache, block_table,
            torch.tensor([0] + step, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            torch.tensor(done, dtype=torch.int32), head_dim**-0.5, max(step), max(done))
        for b, chunk in enumerate(out.split(step)):
            outputs[b].append(chunk)
    assert done == total
    for b in range(3):
        expected = dense_attention(queries[b], keys[b], values[b], 0, head_dim**-0.5, None)
        torch.testing.assert_close(torch.cat(outputs[b]).double(), expected, **TOLERANCES[torch.float32])


def test_rejects_bad_metadata():
    args, _ = make_batch([(3, 2)], num_kv_heads=1, group=2, head_dim=64, block_size=4, dtype=torch.float32)
    with pytest.raises(AssertionError, match="block_table"):
        paged_attention(**{**args, "block_table": args["block_table"].long()}, scale=0.125)
    with pytest.raises(AssertionError, match="max_seq_len"):
        paged_attention(**{**args, "max_seq_len": 4}, scale=0.125)
