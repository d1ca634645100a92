"""CPU attention: decode rows through the C++ kernel, prefill rows through the reference's SDPA.

The C++ kernel (paged_decode_attention.cpp) covers the hot case: one query row per sequence, with
or without a sliding window, reading fp32, bf16, int8 or fp8 caches in place (dequantizing row by
row with the same per-slot or static scales as the reference). It computes in fp32; bf16 queries
(the engine's dtype on AMX / AVX512-BF16 hosts) are widened before it and its rows rounded back
after, which is what the reference does around its fp32 SDPA. Prefill chunks keep the reference's
SDPA (GEMM-shaped work); fp16 queries or caches keep the reference path entirely. The contract is
the reference's (kernels/reference/attention.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from pagedserve.kernels import reference
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.reference.attention import check_paged_attention_args, prefill_attention

reshape_and_cache = reference.reshape_and_cache

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_READS_IN_PLACE = (torch.float32, torch.bfloat16, torch.int8, *_FP8)
_QUERY_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _fp8_table(dtype: torch.dtype) -> Tensor:
    """Every 8-bit code of an fp8 format -> its fp32 value (what ``codes.float()`` gives)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().contiguous()


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, scale: float, max_query_len: int, max_seq_len: int, sliding_window: int | None = None,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> Tensor:
    """Same signature, contract and result as pagedserve.kernels.reference.paged_attention."""
    if not (query.dtype in _QUERY_DTYPES and key_cache.dtype in _READS_IN_PLACE and query.is_contiguous()):
        return reference.paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                         scale, max_query_len, max_seq_len, sliding_window, k_scale, v_scale)
    starts, lens, q_lens, mode = check_paged_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_query_len, max_seq_len,
        sliding_window, k_scale, v_scale)
    query32 = query.float()  # no copy for fp32 queries
    out32 = torch.empty_like(query32)
    table = None
    k_codes, v_codes = key_cache, value_cache
    if key_cache.dtype in _FP8:  # the kernel reads fp8 codes as bytes through a value table
        table = _fp8_table(key_cache.dtype)
        k_codes, v_codes = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    load_extension().paged_decode_attention(out32, query32, k_codes, v_codes, block_table, query_start_loc, seq_lens,
                                            float(scale), sliding_window or 0, k_scale, v_scale, table)
    out = out32.to(query.dtype)  # no copy for fp32; prefill rows are overwritten below either way
    prefill_attention(query, key_cache, value_cache, block_table, starts, lens, q_lens, mode, scale,
                      sliding_window, k_scale, v_scale, out)
    return out
