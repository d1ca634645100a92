"""CPU attention: decode rows through the C++ kernel, everything else through the reference.

The C++ kernel (paged_decode_attention.cpp) covers the hot case, fp32 caches and queries, one
query row per sequence, with or without a sliding window. Prefill chunks keep the reference's
SDPA (flash kernel, GEMM-shaped work), and bf16/fp16/quantized caches keep the reference path
entirely. The contract is the reference's (kernels/reference/attention.py), checked the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.kernels import reference
from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.reference.attention import check_paged_attention_args, prefill_attention

reshape_and_cache = reference.reshape_and_cache


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, scale: float, max_query_len: int, max_seq_len: int, sliding_window: int | None = None,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> Tensor:
    """Same signature, contract and result as pagedserve.kernels.reference.paged_attention."""
    if not (query.dtype == key_cache.dtype == torch.float32 and k_scale is None and query.is_contiguous()):
        return reference.paged_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                         scale, max_query_len, max_seq_len, sliding_window, k_scale, v_scale)
    starts, lens, q_lens, _ = check_paged_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_query_len, max_seq_len,
        sliding_window, k_scale, v_scale)
    out = torch.empty_like(query)
    load_extension().paged_decode_attention(out, query, key_cache, value_cache, block_table, query_start_loc,
                                            seq_lens, float(scale), sliding_window or 0)
    prefill_attention(query, key_cache, value_cache, block_table, starts, lens, q_lens, scale, sliding_window,
                      k_scale, v_scale, out)
    return out
