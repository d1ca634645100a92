"""The argument contract of the paged-KV kernels, asserted the same way by every implementation:
the pure-torch reference (kernels/reference), the CPU kernels (kernels/cpu: attention runs the
reference's checks, once per batch; the C++ K/V store of float caches checks the same contract in
C++, where a Python check per layer would cost more than the store) and the Triton kernels
(kernels/triton). tests/kernels/test_kernel_contract.py holds them to it.

Cache layout: ``key_cache`` / ``value_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]``, contiguous, of one dtype (pagedserve.kernels.kv_dtypes); quantized caches come with
``k_scale`` / ``v_scale`` (pagedserve.kernels.kv_quant.scale_mode).

Only shapes, dtypes and host ints are checked here: nothing is read from the device, so the Triton
launchers run these without a sync. The reference adds the checks that need the metadata's values
(it reads them on the host anyway), and each Triton launcher adds what its own addressing needs
(strides, one device, int32 offsets).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.kernels.kv_quant import scale_mode

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""dtypes of the query and of the K/V a step stores."""


def check_kv_caches(key_cache: Tensor, value_cache: Tensor) -> None:
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, (
        f"caches must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)} "
        f"and {tuple(value_cache.shape)}")
    assert value_cache.dtype == key_cache.dtype, f"cache dtypes differ: {key_cache.dtype} vs {value_cache.dtype}"
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous"


def check_kv_store_args(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                        k_scale: Tensor | None, v_scale: Tensor | None) -> str:
    """reshape_and_cache's contract; returns the scale mode ("none", "dynamic" or "static").

    key, value: [num_tokens, num_kv_heads, head_dim] fp32/bf16/fp16; slot_mapping: int64 [num_tokens].
    """
    check_kv_caches(key_cache, value_cache)
    _, _, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    for name, x in (("key", key), ("value", value)):
        assert x.dim() == 3 and tuple(x.shape) == (num_tokens, num_kv_heads, head_dim), (
            f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(x.shape)}")
        assert x.dtype in ACTIVATION_DTYPES, f"{name} dtype {x.dtype} not supported"
    assert slot_mapping.dtype == torch.int64 and tuple(slot_mapping.shape) == (num_tokens,), (
        f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    return scale_mode(key_cache, k_scale, v_scale)


def check_paged_attention_args(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                               query_start_loc: Tensor, seq_lens: Tensor, max_seq_len: int,
                               sliding_window: int | None, k_scale: Tensor | None, v_scale: Tensor | None,
                               softcap: float | None = None) -> str:
    """paged_attention's contract, as far as it holds without reading the metadata's values;
    returns the scale mode.

    query: [num_tokens, num_kv_heads * group, head_dim] fp32/bf16/fp16; block_table: int32
    [B, max_blocks]; query_start_loc: int32 [B + 1]; seq_lens: int32 [B]; max_seq_len must fit the
    block table; sliding_window: None or positive; softcap: None or positive.
    """
    check_kv_caches(key_cache, value_cache)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert query.dim() == 3 and query.shape[2] == head_dim and query.shape[1] % num_kv_heads == 0, (
        f"query must be [num_tokens, k * {num_kv_heads}, {head_dim}], got {tuple(query.shape)}")
    assert query.dtype in ACTIVATION_DTYPES, f"query dtype {query.dtype} not supported"
    num_seqs = seq_lens.shape[0]
    assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == num_seqs, (
        f"block_table must be int32 [{num_seqs}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    assert query_start_loc.dtype == torch.int32 and tuple(query_start_loc.shape) == (num_seqs + 1,), (
        f"query_start_loc must be int32 [{num_seqs + 1}], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    assert seq_lens.dtype == torch.int32 and seq_lens.dim() == 1, f"seq_lens must be int32 [B], got {seq_lens.dtype}"
    assert max_seq_len <= block_table.shape[1] * block_size, (
        f"block_table holds {block_table.shape[1]} blocks of {block_size}, max_seq_len is {max_seq_len}")
    assert sliding_window is None or sliding_window > 0, f"sliding_window must be positive, got {sliding_window}"
    assert softcap is None or softcap > 0, f"softcap must be positive, got {softcap}"
    return scale_mode(key_cache, k_scale, v_scale)
