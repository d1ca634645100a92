"""C++ CPU paged attention vs the float64 dense oracle and the pure-torch reference.

Batches come from test_reference_attention.make_batch: caches start full of NaN and stale
block-table entries point at random blocks, so a read outside a sequence's own tokens fails.
The first test in a fresh environment compiles the extension (about a minute on 2 cores).

Every test runs twice: with the decode kernel's vector code this CPU gets, and with its AVX2 build
(F8x2, what CPUs without AVX-512 run) forced, where the CPU has AVX2.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.layers.attention import select_attention_backend
from pagedserve.kernels import cpu, reference
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import (amx_available, avx2_fp32_available, avx512_available,
                                           bf16_fp32_math_available)

from tests.kernels.quant_batches import QUANT_KV_DTYPES, make_kv_batch
from tests.kernels.test_reference_attention import MIXED, TOLERANCES, dense_attention, make_batch

DECODES = [(c, 1) for c in (0, 1, 15, 16, 17, 100, 257, 700)]


@pytest.fixture(autouse=True, params=["native", "avx2"])
def decode_vector_code(request):
    """The decode kernel's vector code: the one this CPU is best served by, or the AVX2 build."""
    if request.param == "avx2" and not avx2_fp32_available():
        pytest.skip("this CPU has no AVX2 with FMA")
    ext = load_extension()
    before = ext.force_avx2_vector_code(request.param == "avx2")
    yield request.param
    ext.force_avx2_vector_code(before)


def run_both(specs, *, num_kv_heads, group, head_dim, block_size, window=None, dtype=torch.float32, seed=0):
    args, (keys, values, queries) = make_batch(specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                               block_size=block_size, dtype=dtype, seed=seed)
    scale = head_dim**-0.5
    out = cpu.paged_attention(**args, scale=scale, sliding_window=window)
    expected = torch.cat([dense_attention(q, k, v, c, scale, window)
                          for (c, _), q, k, v in zip(specs, queries, keys, values)])
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    return out, reference.paged_attention(**args, scale=scale, sliding_window=window)


# head_dim 36: not a multiple of 8, so the kernel takes its scalar dot-product path. head_dim 64
# and 128 take the vector path, which reads 32 positions per step across blocks and serves up to
# 4 (64) or 2 (128) query heads per pass over a KV head: groups 5 and 7 take uneven passes, blocks
# of 48 and 64 slots are longer than a step.
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size",
                         [(3, 3, 64, 16), (2, 1, 64, 1), (1, 8, 128, 16), (4, 2, 32, 32), (2, 3, 80, 7), (2, 3, 36, 16),
                          (2, 5, 64, 64), (1, 7, 64, 48), (2, 3, 128, 5), (1, 4, 64, 16), (1, 4, 256, 16),
                          (2, 3, 256, 5)])
@pytest.mark.parametrize("specs", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_matches_dense_and_reference(specs, num_kv_heads, group, head_dim, block_size):
    out, ref = run_both(specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# head_dim 256, one KV head for 4 query heads: Gemma 3 270M's shape (its vector path takes one
# query head per pass).
@pytest.mark.parametrize("window", [1, 7, 16, 50, 4096])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 3, 64), (1, 4, 256)])
def test_sliding_window(window, block_size, num_kv_heads, group, head_dim):
    run_both(DECODES + MIXED, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
             window=window)


CACHE_CASES = [(torch.bfloat16, False)] + [(d, static) for d in QUANT_KV_DTYPES for static in (False, True)]


@pytest.mark.parametrize("cache_dtype,static", CACHE_CASES,
                         ids=[f"{d}-{'static' if s else 'dynamic'}" for d, s in CACHE_CASES])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,window",
                         [(3, 3, 64, 16, None), (2, 1, 64, 1, 50), (1, 8, 128, 16, None), (1, 5, 64, 64, None),
                          (2, 3, 128, 48, 70), (1, 4, 256, 16, 30)])
def test_reads_bf16_and_quantized_caches_in_place(cache_dtype, static, num_kv_heads, group, head_dim, block_size,
                                                   window):
    # Queries and the oracle's K/V are the exact values the cache holds (dequantized codes); unused
    # slots hold NaN codes or NaN scales, so a stray read fails.
    args, (keys, values, queries) = make_kv_batch(
        DECODES + MIXED, cache_dtype=cache_dtype, static=static, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, block_size=block_size)
    scale = head_dim**-0.5
    out = cpu.paged_attention(**args, scale=scale, sliding_window=window)
    expected = torch.cat([dense_attention(q, k, v, c, scale, window)
                          for (c, _), q, k, v in zip(DECODES + MIXED, queries, keys, values)])
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
    ref = reference.paged_attention(**args, scale=scale, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# With fewer decode rows than 4 per thread, long contexts are split into block ranges whose partial
# softmax states are merged by log-sum-exp (batch-1 decode on every core); a wrong merge weight or
# range boundary shows against the dense oracle.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [[(700, 1)], [(257, 1), (1000, 1)], [(70, 1), (5, 3), (300, 1)]],
                         ids=["one", "two", "with-prefill"])
def test_long_contexts_split_into_ranges(specs, dtype, window, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_both(specs, num_kv_heads=3, group=3, head_dim=64, block_size=16, window=window, dtype=dtype)
        run_both(specs, num_kv_heads=2, group=2, head_dim=36, block_size=5, window=window, dtype=dtype)
    finally:
        torch.set_num_threads(before)


def test_fp16_takes_the_reference_path():
    out, ref = run_both(MIXED, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float16)
    assert torch.equal(out, ref)


def _without_the_reference_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("bf16 queries fell back to the reference path")
    monkeypatch.setattr(cpu.attention.reference, "paged_attention", refuse)


# bf16 queries are the engine's dtype on AMX hosts. Kernel and reference both attend in fp32 and
# round once to bf16, so they agree to within one bf16 rounding step.
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("specs", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_bf16_queries_run_through_the_kernel(specs, cache_dtype, monkeypatch):
    if cache_dtype == torch.bfloat16:
        args, (keys, values, queries) = make_batch(specs, num_kv_heads=3, group=3, head_dim=64, block_size=16,
                                                   dtype=torch.bfloat16)
    else:
        args, (keys, values, queries) = make_kv_batch(specs, cache_dtype=cache_dtype, static=False, num_kv_heads=3,
                                                      group=3, head_dim=64, block_size=16)
        args["query"] = args["query"].to(torch.bfloat16)
        queries = [q.to(torch.bfloat16) for q in queries]
    scale = 64**-0.5
    ref = reference.paged_attention(**args, scale=scale)
    _without_the_reference_path(monkeypatch)
    out = cpu.paged_attention(**args, scale=scale)
    assert out.dtype == torch.bfloat16
    expected = torch.cat([dense_attention(q, k, v, c, scale, None)
                          for (c, _), q, k, v in zip(specs, queries, keys, values)])
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(out, ref, atol=8e-3, rtol=8e-3)


PREFILL_KERNELS = [("avx512", torch.float32), ("avx512", torch.bfloat16), ("avx2", torch.float32),
                   ("amx", torch.bfloat16)]
"""The prefill kernel's entries and the dtype each is tested in: amx_prefill_attention.cpp computes
bf16 with bf16 probabilities (as torch's bf16 flash attention does), within the same bf16 step."""


# fp32 prefill rows over an fp32 cache go through paged_prefill_attention.cpp where the CPU has
# AVX-512 or AVX2 (avx2: the kernel choice of a CPU without AVX-512, which every AVX-512 CPU can
# run too), and bf16 rows over a bf16 cache where it has AVX-512 but no bf16 dot products: whole
# prompts, chunks after a cached prefix, 1-2 row chunks, rows not a multiple of its 12-row blocks
# (6-row slices on AVX2), keys not a multiple of its 32-key panels or of 16 (the softmax's
# vectors), GQA groups, head_dim 32 / 64 / 128 (the bf16 rows on every AVX-512 CPU, native bf16 or
# not). bf16 is computed in fp32 and rounded once, as the
# reference's SDPA does: within a bf16 step of it.
@pytest.mark.parametrize("isa,dtype", PREFILL_KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size",
                         [(3, 3, 64, 16), (1, 8, 128, 16), (4, 2, 32, 32), (2, 5, 64, 7), (2, 1, 64, 1)])
@pytest.mark.parametrize("specs", [[(0, 512)], [(300, 250), (0, 13), (40, 1), (7, 2)], MIXED],
                         ids=["prompt", "chunks", "mixed"])
def test_prefill_rows_run_through_the_prefill_kernel(specs, num_kv_heads, group, head_dim, block_size, threads,
                                                     dtype, isa, monkeypatch):
    calls, entry = route_prefill_rows_to_the_kernel(isa, dtype, monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, ref = run_both(specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                            dtype=dtype)
    finally:
        torch.set_num_threads(before)
    assert calls and set(calls) == {entry}
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)


# Sliding windows in the prefill kernel: a row at position p sees keys (p - window, p]. Windows of
# 1 key, shorter and longer than a 32-key panel and than a 12-row block, 512 (Gemma 3); whole prompts
# longer than the window, chunks after a prefix longer than the window (so its oldest keys are not
# gathered), chunks that start inside it; Gemma 3's shape and a GQA one with odd blocks.
@pytest.mark.parametrize("isa,dtype", PREFILL_KERNELS)
@pytest.mark.parametrize("window", [1, 7, 33, 100, 512])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(1, 4, 256, 16), (2, 3, 64, 7)])
@pytest.mark.parametrize("specs", [[(0, 700)], [(600, 300), (0, 13), (40, 1), (90, 70), (7, 2)]],
                         ids=["prompt", "chunks"])
def test_prefill_kernel_sliding_windows(specs, num_kv_heads, group, head_dim, block_size, window, dtype, isa,
                                        monkeypatch):
    calls, entry = route_prefill_rows_to_the_kernel(isa, dtype, monkeypatch)
    out, ref = run_both(specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                        dtype=dtype, window=window)
    assert calls and set(calls) == {entry}
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)


# Contexts longer than the AMX kernel's 1,024-key softmax chunks: each row's running maximum and
# sums carried from chunk to chunk (rescaled when a later chunk holds a larger score), rows whose
# window starts past a chunk or whose causal limit ends before one; the other kernels on the same
# batches. Prompts of 2+ chunks, chunks after a prefix of several, a GQA group sharing each chunk.
@pytest.mark.parametrize("isa,dtype", PREFILL_KERNELS)
@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(3, 3, 64, 16), (1, 4, 256, 16)])
def test_prefill_contexts_longer_than_a_key_chunk(num_kv_heads, group, head_dim, block_size, window, dtype, isa,
                                                  monkeypatch):
    calls, entry = route_prefill_rows_to_the_kernel(isa, dtype, monkeypatch)
    specs = [(2200, 90), (0, 1100), (1000, 45)]
    out, ref = run_both(specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                        dtype=dtype, window=window)
    assert calls and set(calls) == {entry}
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)


def route_prefill_rows_to_the_kernel(isa: str, dtype: torch.dtype, monkeypatch) -> tuple[list[str], str]:
    """Prefill rows through the prefill kernel's `isa` entry, the reference SDPA refused; returns the
    list its calls are recorded in and the entry's name (skips where the CPU cannot run it)."""
    if isa == "amx" and not amx_available():
        pytest.skip("this CPU has no AMX")
    if isa != "amx":  # an AMX CPU routes bf16 rows to the AMX entry: test the others by hand
        monkeypatch.setattr(cpu.attention, "amx_available", lambda: False)
    if isa == "avx512" and not avx512_available():
        pytest.skip("this CPU has no AVX-512")
    if isa == "avx2":
        if not avx2_fp32_available():
            pytest.skip("this CPU has no AVX2 with FMA (the reference SDPA runs)")
        monkeypatch.setattr(cpu.attention, "avx512_available", lambda: False)
    if dtype == torch.bfloat16 and isa != "amx" and not bf16_fp32_math_available():
        # Native bf16 CPUs route bf16 prefill rows to torch's SDPA (the test below), but they run
        # the kernel as well as any AVX-512 CPU does: test it here too, routed to it by hand.
        monkeypatch.setattr(cpu.attention, "bf16_fp32_math_available", lambda: True)
    ext, entry = load_extension(), "paged_prefill_attention" + {"avx2": "_avx2", "amx": "_amx"}.get(isa, "")
    calls = []
    real_entry = getattr(ext, entry)
    monkeypatch.setattr(ext, entry, lambda *args: calls.append(entry) or real_entry(*args))

    def refuse(*args, **kwargs):
        raise AssertionError("prefill rows fell back to the reference SDPA")

    monkeypatch.setattr(cpu.attention, "prefill_attention", refuse)
    return calls, entry


def test_bf16_prefill_rows_take_sdpa_where_bf16_is_native(monkeypatch):
    """With bf16 dot products but no AMX (AVX512-BF16) torch's bf16 SDPA beats fp32 math: it keeps
    them; AMX takes the AMX kernel."""
    monkeypatch.setattr(cpu.attention, "amx_available", lambda: True)
    kernel_for = cpu.attention._prefill_kernel
    bf16, fp32 = torch.empty(2, 3, 64, dtype=torch.bfloat16), torch.empty(2, 3, 64)
    assert kernel_for(bf16, bf16) == "paged_prefill_attention_amx"
    assert kernel_for(bf16, fp32) is None and kernel_for(bf16[..., :48], bf16[..., :48]) is None
    monkeypatch.setattr(cpu.attention, "amx_available", lambda: False)
    monkeypatch.setattr(cpu.attention, "bf16_fp32_math_available", lambda: True)
    assert kernel_for(bf16, bf16) == "paged_prefill_attention"  # fp32 math on AVX-512, as patched
    monkeypatch.setattr(cpu.attention, "bf16_fp32_math_available", lambda: False)
    assert kernel_for(bf16, bf16) is None
    calls = []
    real = cpu.attention.prefill_attention
    monkeypatch.setattr(cpu.attention, "prefill_attention", lambda *a, **kw: calls.append(a[-1]) or real(*a, **kw))
    run_both(MIXED, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    assert calls == [torch.bfloat16]  # SDPA in bf16, once per batch with prefill rows


# Each prefill entry point with the dtype it reads and whether this CPU runs it; all three share
# one argument check (kernels/cpu/prefill_args.h), named after the kernel in every message.
PREFILL_ENTRIES = {"paged_prefill_attention": (torch.float32, avx512_available),
                   "paged_prefill_attention_avx2": (torch.float32, avx2_fp32_available),
                   "paged_prefill_attention_amx": (torch.bfloat16, amx_available)}


@pytest.mark.parametrize("entry", list(PREFILL_ENTRIES))
def test_the_prefill_kernels_reject_what_they_cannot_read(entry):
    dtype, runs_here = PREFILL_ENTRIES[entry]
    if not runs_here():
        pytest.skip(f"this CPU cannot run {entry}")
    args, _ = make_batch([(3, 5)], num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=dtype)
    call = getattr(load_extension(), entry)
    out = torch.empty_like(args["query"])
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    with pytest.raises(RuntimeError, match=f"{entry}: key_cache must be a contiguous 4-D {names[dtype]} tensor, "
                                           f"got {names[other]}"):
        call(out, args["query"], args["key_cache"].to(other), args["value_cache"], args["block_table"],
             args["query_start_loc"], args["seq_lens"], 0.1)
    with pytest.raises(RuntimeError, match=f"{entry}: .*got float16"):
        call(out.half(), args["query"].half(), args["key_cache"].half(), args["value_cache"].half(),
             args["block_table"], args["query_start_loc"], args["seq_lens"], 0.1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        call(out[..., :48].contiguous(), args["query"][..., :48].contiguous(), args["key_cache"][..., :48].contiguous(),
             args["value_cache"][..., :48].contiguous(), args["block_table"], args["query_start_loc"],
             args["seq_lens"], 0.1)
    with pytest.raises(RuntimeError, match="contiguous int32"):
        call(out, args["query"], args["key_cache"], args["value_cache"], args["block_table"].long(),
             args["query_start_loc"], args["seq_lens"], 0.1)
    too_long = args["seq_lens"] + args["block_table"].shape[1] * 16
    with pytest.raises(RuntimeError, match="more blocks than block_table holds"):
        call(out, args["query"], args["key_cache"], args["value_cache"], args["block_table"],
             args["query_start_loc"], too_long, 0.1)


def test_batch_checks_run_once_per_batch_and_again_when_it_changes(monkeypatch):
    """The layers of one forward pass share the batch's metadata tensors, so its host-side checks
    run once; an in-place change to a metadata tensor or a new batch is checked again."""
    import pagedserve.kernels.cpu.attention as cpu_attention

    calls = []
    real = cpu_attention.check_paged_attention_args
    monkeypatch.setattr(cpu_attention, "check_paged_attention_args", lambda *a: calls.append(1) or real(*a))
    args, _ = make_batch(DECODES, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    want = reference.paged_attention(**args, scale=0.125)
    for _layer in range(3):
        torch.testing.assert_close(cpu.paged_attention(**args, scale=0.125), want, atol=2e-5, rtol=2e-5)
    assert len(calls) == 1
    other, _ = make_batch(MIXED, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=1)
    torch.testing.assert_close(cpu.paged_attention(**other, scale=0.125),
                               reference.paged_attention(**other, scale=0.125), atol=2e-5, rtol=2e-5)
    assert len(calls) == 2
    args["seq_lens"][0] = args["block_table"].shape[1] * 16 + 1  # in place: past the block table
    with pytest.raises(AssertionError, match="max_seq_len"):
        cpu.paged_attention(**args, scale=0.125)


def test_the_kernel_rejects_what_it_cannot_read():
    args, _ = make_batch(DECODES, num_kv_heads=1, group=1, head_dim=64, block_size=16, dtype=torch.float32)
    ext = cpu.load_extension()
    out = torch.empty_like(args["query"])
    with pytest.raises(RuntimeError, match="int32"):
        ext.paged_decode_attention(out, args["query"], args["key_cache"], args["value_cache"],
                                   args["block_table"].long(), args["query_start_loc"], args["seq_lens"], 0.1, 0)
    too_long = args["seq_lens"].clone()
    too_long[0] = args["block_table"].shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        ext.paged_decode_attention(out, args["query"], args["key_cache"], args["value_cache"],
                                   args["block_table"], args["query_start_loc"], too_long, 0.1, 0)
    int8 = args["key_cache"].to(torch.int8)
    with pytest.raises(RuntimeError, match="quantized caches need k_scale and v_scale"):
        ext.paged_decode_attention(out, args["query"], int8, int8, args["block_table"], args["query_start_loc"],
                                   args["seq_lens"], 0.1, 0)
    with pytest.raises(RuntimeError, match="code table"):
        codes = int8.view(torch.uint8)
        ext.paged_decode_attention(out, args["query"], codes, codes, args["block_table"], args["query_start_loc"],
                                   args["seq_lens"], 0.1, 0, torch.tensor(1.0), torch.tensor(1.0))


def test_auto_selects_the_cpu_kernels():
    assert select_attention_backend("auto", torch.device("cpu")) is cpu
    assert select_attention_backend("cpu", torch.device("cpu")) is cpu
    assert select_attention_backend("reference", torch.device("cpu")) is reference
