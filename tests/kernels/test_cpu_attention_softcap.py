"""Attention logit softcapping (Gemma 2) inside the C++ CPU kernels vs the float64 dense oracle
and the pure-torch reference: scores scaled, then tanh(s / cap) * cap, then masked and softmaxed.

The scale (3 / sqrt(head_dim)) puts this batch's scaled scores well above the caps, so capping
changes every output (asserted), and the reference path is refused wherever a kernel should serve
the rows. Every test runs with the decode kernel's native vector code and its forced AVX2 build
(test_cpu_attention's autouse fixture, imported below).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu, reference
from pagedserve.kernels.cpu.build import load_extension

from tests.kernels.quant_batches import QUANT_KV_DTYPES, make_kv_batch
from tests.kernels.test_cpu_attention import (DECODES, PREFILL_KERNELS, decode_vector_code,  # noqa: F401 (autouse)
                                              route_prefill_rows_to_the_kernel)
from tests.kernels.test_reference_attention import MIXED, TOLERANCES, dense_attention, make_batch

CAP = 2.0


def dense(specs, queries, keys, values, scale, window, softcap):
    return torch.cat([dense_attention(q, k, v, c, scale, window, softcap)
                      for (c, _), q, k, v in zip(specs, queries, keys, values)])


def refuse_reference_decode(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("softcapped rows fell back to the reference path")
    monkeypatch.setattr(cpu.attention.reference, "paged_attention", refuse)


def check_capped(args, specs, tensors, scale, window, tolerance, monkeypatch, ref_tolerance=2e-5):
    """cpu.paged_attention with the cap vs the dense oracle (capped) and the reference, the
    reference's whole-batch path refused; the cap acts."""
    keys, values, queries = tensors
    ref = reference.paged_attention(**args, scale=scale, sliding_window=window, softcap=CAP)
    refuse_reference_decode(monkeypatch)
    out = cpu.paged_attention(**args, scale=scale, sliding_window=window, softcap=CAP)
    want = dense(specs, queries, keys, values, scale, window, CAP)
    torch.testing.assert_close(out.double(), want, **tolerance)
    torch.testing.assert_close(out, ref, atol=ref_tolerance, rtol=ref_tolerance)
    uncapped = dense(specs, queries, keys, values, scale, window, None)
    assert (want - uncapped).abs().max() > 0.1, "the cap does not act on this batch: the test would not test it"


# Decode rows through every decode variant: head_dim 36 and 32 (the scalar any-head_dim code), 64,
# 128 and 256 (the vector code, 4 / 2 / 1 query heads per pass, uneven GQA passes), blocks
# shorter and longer than a 32-position chunk; long contexts split into ranges merged by
# log-sum-exp (700 positions); with and without a window shorter than the contexts.
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size",
                         [(2, 3, 36, 16), (2, 2, 32, 7), (3, 3, 64, 16), (1, 5, 64, 64), (1, 8, 128, 16),
                          (1, 4, 256, 16), (2, 3, 256, 5)])
def test_decode_rows_capped_in_the_kernel(num_kv_heads, group, head_dim, block_size, window, monkeypatch):
    args, tensors = make_batch(DECODES, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                               block_size=block_size, dtype=torch.float32, seed=4)
    scale = 3 * head_dim**-0.5
    ref = reference.paged_attention(**args, scale=scale, sliding_window=window, softcap=CAP)
    refuse_reference_decode(monkeypatch)
    out = cpu.paged_attention(**args, scale=scale, sliding_window=window, softcap=CAP)
    keys, values, queries = tensors
    want = dense(DECODES, queries, keys, values, scale, window, CAP)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[torch.float32])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert (want - dense(DECODES, queries, keys, values, scale, window, None)).abs().max() > 0.1


# Prefill rows through the prefill kernel's AVX-512 (fp32, bf16) and AVX2 entries: whole prompts
# longer than a window, chunks after a cached prefix, 1-2 row chunks, Gemma 2 2B's head shape
# (head_dim 256, 8 heads over 4 KV heads: 2 per KV head) and a GQA one with odd blocks.
@pytest.mark.parametrize("isa,dtype", PREFILL_KERNELS)
@pytest.mark.parametrize("window", [None, 33])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(4, 2, 256, 16), (2, 3, 64, 7)])
@pytest.mark.parametrize("specs", [[(0, 150)], [(100, 60), (0, 13), (40, 1), (7, 2)], MIXED, [(1100, 40)]],
                         ids=["prompt", "chunks", "mixed", "past-a-key-chunk"])
def test_prefill_rows_capped_in_the_kernel(specs, num_kv_heads, group, head_dim, block_size, window, dtype, isa,
                                           monkeypatch):
    calls, entry = route_prefill_rows_to_the_kernel(isa, dtype, monkeypatch)
    args, tensors = make_batch(specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                               block_size=block_size, dtype=dtype, seed=5)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    check_capped(args, specs, tensors, 3 * head_dim**-0.5, window, TOLERANCES[dtype], monkeypatch, tolerance)
    assert calls and set(calls) == {entry}


# bf16 and quantized caches (int8, fp8; per-slot and static scales): their decode rows are capped
# in the decode kernel; their prefill rows take the reference's explicit-score path (this host's
# bf16 is native, so bf16 SDPA; int8 / fp8 have no prefill kernel), which must get the cap too.
CACHE_CASES = [(torch.bfloat16, False)] + [(d, static) for d in QUANT_KV_DTYPES for static in (False, True)]


@pytest.mark.parametrize("cache_dtype,static", CACHE_CASES,
                         ids=[f"{d}-{'static' if s else 'dynamic'}" for d, s in CACHE_CASES])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,window",
                         [(3, 3, 64, 16, None), (1, 4, 256, 16, 30), (2, 2, 36, 5, None)])
def test_bf16_and_quantized_caches_capped(cache_dtype, static, num_kv_heads, group, head_dim, block_size, window,
                                          monkeypatch):
    specs = DECODES + MIXED
    args, tensors = make_kv_batch(specs, cache_dtype=cache_dtype, static=static, num_kv_heads=num_kv_heads,
                                  group=group, head_dim=head_dim, block_size=block_size, seed=6)
    check_capped(args, specs, tensors, 3 * head_dim**-0.5, window, TOLERANCES[torch.float32], monkeypatch)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_bf16_queries_capped_in_the_decode_kernel(cache_dtype, monkeypatch):
    """bf16 queries (the engine's dtype on bf16 hosts): computed in fp32, rounded once."""
    args, (keys, values, queries) = make_kv_batch(DECODES, cache_dtype=cache_dtype, query_dtype=torch.bfloat16,
                                                  num_kv_heads=3, group=3, head_dim=64, block_size=16, seed=7)
    scale = 3 * 64**-0.5
    ref = reference.paged_attention(**args, scale=scale, softcap=CAP)
    refuse_reference_decode(monkeypatch)
    out = cpu.paged_attention(**args, scale=scale, softcap=CAP)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense(DECODES, queries, keys, values, scale, None, CAP),
                               **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(out, ref, atol=8e-3, rtol=8e-3)


def test_the_kernels_reject_a_negative_softcap():
    if not cpu.attention.avx512_available():
        pytest.skip("this CPU cannot run paged_prefill_attention")
    args, _ = make_batch([(3, 5), (7, 1)], num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float32)
    ext = load_extension()
    out = torch.empty_like(args["query"])
    positional = (out, args["query"], args["key_cache"], args["value_cache"], args["block_table"],
                  args["query_start_loc"], args["seq_lens"], 0.1, 0)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ext.paged_decode_attention(*positional, softcap=-1.0)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        ext.paged_prefill_attention(*positional, softcap=-1.0)
