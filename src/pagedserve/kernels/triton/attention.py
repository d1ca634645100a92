"""Triton paged attention over a packed varlen batch: prefill chunks and decodes in one launch.

Twin of pagedserve.kernels.reference.attention.paged_attention (same signature, same contract).

Work split. A program owns (query block, KV head, split):

* query block: up to BLOCK_Q consecutive query tokens of ONE sequence, times the `group` query
  heads that share the KV head (GQA): BLOCK_M >= BLOCK_Q * group rows, so every K/V tile loaded
  serves all heads of the group. A decode is one token x group heads.
  Query blocks are numbered per sequence as ``query_start_loc[b] // BLOCK_Q + b + j``: an upper
  bound that needs no host sync; blocks past a sequence's last token exit at once. The launcher
  maps block -> sequence with one device `searchsorted` (no host read of the metadata).
* split (split-K): the key range a query block reads is cut into NUM_SPLITS contiguous runs of
  BLOCK_N-key tiles, each its own program, so a handful of long decodes still fills the GPU.
  Splits write (max, sum, unnormalized acc) partials; `_reduce_splits_kernel` merges them.
  With NUM_SPLITS == 1 the attention kernel writes the output directly.

Keys are read through the block table one tile at a time (any block_size: each key position is
mapped to ``block_table[b, pos // block_size] * block_size + pos % block_size``). Quantized caches
are dequantized on load, folded into the math: the per-key K scale multiplies the score column and
the per-key V scale multiplies the probability column, so no dequantized copy of a tile is made.
Softmax runs in the exp2 domain (log2(e) folded into the scale), fp32 throughout. With a softcap
(Gemma 2) the scaled score is capped in natural units, c * tanh(s / c), before log2(e) is applied;
tanh is written with exp2, which tl has on every backend (1 - 2 / (e^(2x) + 1): +-1 at the extremes,
never NaN). Cache and
query offsets are int64 (slot * num_kv_heads * head_dim overflows int32 on large pools).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels import contract
from pagedserve.kernels.kv_quant import is_quantized
from pagedserve.kernels.triton.kv_store import MODES
from pagedserve.kernels.triton.quant import check_cache_dtype_supported

__all__ = ["paged_attention"]

BLOCK_N = 64  # keys per tile
MAX_SPLITS = 16
_LOG2E = 1.4426950408889634
# Running-max start: finite, so fully masked tiles give exp2(-inf) = 0, never NaN. A constexpr
# because jitted code may only read constexpr globals.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E_C = tl.constexpr(_LOG2E)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr, q_block_seq_ptr,
    qk_scale, sliding_window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    num_kv_heads, group, head_dim, block_size,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, QUANT: tl.constexpr, USE_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(q_block_seq_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + b)
    q_end = tl.load(query_start_loc_ptr + b + 1)
    seq_len = tl.load(seq_lens_ptr + b)
    q_first = q_start + (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q  # first query token of this block
    if q_first >= q_end:
        return
    context = seq_len - (q_end - q_start)  # tokens cached before this step

    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // group  # query token of each row
    head = kv_head * group + rows % group
    row_ok = (rows // group < BLOCK_Q) & (tok < q_end)
    q_pos = context + (tok - q_start)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys this block reads: [lo, hi), cut into NUM_SPLITS runs of whole tiles.
    hi = context + (tl.minimum(q_first + BLOCK_Q, q_end) - q_start)  # last row's position + 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, context + (q_first - q_start) + 1 - sliding_window)
    tile_lo = lo // BLOCK_N
    num_tiles = tl.cdiv(hi, BLOCK_N) - tile_lo
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_lo + num_tiles)

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for t in range(t_begin, t_end):
        k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = (k_pos >= lo) & (k_pos < hi)
        blk = tl.load(bt_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        in_blk = k_pos % block_size
        kv_off = blk * stride_c_blk + in_blk * stride_c_tok + kv_head * stride_c_head  # [BLOCK_N] int64
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None],
                    other=0.0)  # [D, N]
        if FP32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        if QUANT == 1:
            # Scales are [slots, num_kv_heads]; slot = blk * block_size + in_blk.
            sc_off = (blk * block_size + in_blk) * num_kv_heads + kv_head
            s = s * tl.load(k_scale_ptr + sc_off, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        elif QUANT == 2:
            s = s * tl.load(k_scale_ptr)
        s = s * qk_scale
        if USE_SOFTCAP:  # qk_scale is the plain scale here: cap, then into the exp2 domain
            s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * _LOG2E_C / softcap)) + 1.0)) * _LOG2E_C
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT == 1:
            p = p * tl.load(v_scale_ptr + sc_off, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        elif QUANT == 2:
            p = p * tl.load(v_scale_ptr)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [N, D]
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials: ml [num_tokens, num_heads, NUM_SPLITS, 2] and acc [.., NUM_SPLITS, BLOCK_D], fp32.
        part = (tok.to(tl.int64) * (num_kv_heads * group) + head) * NUM_SPLITS + split
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(part_ml_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh, num_rows, num_heads,
                          head_dim, NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Merge the split partials of BLOCK_R (token, head) rows: tiles [BLOCK_R, BLOCK_S(, BLOCK_D)]."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = token * num_heads + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok = (r[:, None] < num_rows) & (s[None, :] < NUM_SPLITS)
    part = r[:, None] * NUM_SPLITS + s[None, :]
    m = tl.load(part_ml_ptr + part * 2, mask=ok, other=_NEG_BIG)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, :, None] * BLOCK_D + d[None, None, :], mask=ok[:, :, None], other=0.0)
    # A split that saw no key for a row holds m = -1e30: weight exp2(-huge) = 0. Padding rows sum
    # to 0 and are never stored.
    w = tl.exp2(m - tl.max(m, axis=1)[:, None])
    total = tl.sum(w * l, axis=1)
    total = tl.where(total > 0, total, 1.0)
    out = tl.sum(w[:, :, None] * acc, axis=1) / total[:, None]
    o_ptr = out_ptr + (r // num_heads)[:, None] * stride_ot + (r % num_heads)[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=(r[:, None] < num_rows) & (d[None, :] < head_dim))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split-K factor: enough programs for about two waves of the GPU, at least four BLOCK_N
    tiles per split, at most MAX_SPLITS. 1 off CUDA (the interpreter: tests force more)."""
    if device.type != "cuda":
        return 1
    target = 2 * _num_sms(device)
    if num_programs >= target:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(target, num_programs), max_seq_len // (4 * BLOCK_N)))


def _fp32_dot(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """int8/fp8 codes are exact in bf16/fp16, so a 16-bit query keeps 16-bit (tensor-core) dots; an
    fp32 query, or a float cache of another dtype, computes in fp32 ("ieee": no TF32 rounding).
    Off CUDA (the interpreter) bf16 dots run in fp32 too: triton 3.9's interpreter multiplies bf16
    operands as their raw uint16 bit patterns. fp16 dots are exact there and keep the 16-bit path."""
    if query.dtype == torch.float32:
        return True
    if key_cache.dtype != query.dtype and not is_quantized(key_cache.dtype):
        return True
    return query.dtype == torch.bfloat16 and query.device.type != "cuda"


def paged_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
    max_seq_len: int, sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a packed varlen batch over the paged KV cache (see the reference twin).

    query:           [num_tokens, num_heads, head_dim] fp32/bf16/fp16, last dim contiguous.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same dtype
                     (fp32/bf16/fp16 or int8/fp8 with k_scale/v_scale, see reshape_and_cache).
    block_table:     int32 [B, max_blocks], last dim contiguous.
    query_start_loc: int32 [B + 1]; seq_lens: int32 [B]; both contiguous, on the query's device.
    max_query_len, max_seq_len: host ints, upper bounds of the batch (size the grid; never synced).
    softcap:         None, or c: scores become c * tanh(s / c) before the softmax (Gemma 2).
    Returns [num_tokens, num_heads, head_dim] in query's dtype.
    """
    mode = contract.check_paged_attention_args(query, key_cache, value_cache, block_table, query_start_loc,
                                               seq_lens, max_seq_len, sliding_window, k_scale, v_scale, softcap)
    # What this kernel's addressing needs beyond the shared contract:
    assert query.stride(2) == 1, f"query must be contiguous in head_dim, strides {query.stride()}"
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous(), "query_start_loc/seq_lens must be contiguous"
    for name, t in (("key_cache", key_cache), ("block_table", block_table),
                    ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        assert t.device == query.device, f"{name} is on {t.device}, query on {query.device}"
    check_cache_dtype_supported(key_cache.dtype, key_cache.device)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    # Positions, tokens and block ids are int32 in the kernel; offsets that multiply them are int64.
    assert query.shape[0] < 2**31 and key_cache.shape[0] * block_size < 2**31

    num_tokens, num_heads = query.shape[0], query.shape[1]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    # Rows = BLOCK_Q tokens x group heads: at least 16 (tl.dot), 64 when a prefill chunk is in the batch.
    block_m = max(triton.next_power_of_2(group), 64 if max_query_len * group > 16 else 16)
    block_q = block_m // group
    num_q_blocks = num_tokens // block_q + num_seqs
    # Query block -> sequence, on the device: the last b with query_start_loc[b] // BLOCK_Q + b <= pid.
    seq_ids = torch.arange(num_seqs, device=query.device, dtype=torch.int32)
    bases = torch.div(query_start_loc[:-1], block_q, rounding_mode="floor") + seq_ids
    pids = torch.arange(num_q_blocks, device=query.device, dtype=torch.int32)
    q_block_seq = (torch.searchsorted(bases, pids, right=True) - 1).to(torch.int32)

    splits = num_splits(num_q_blocks * num_kv_heads, max_seq_len, query.device)
    block_d = triton.next_power_of_2(head_dim)
    if splits > 1:
        part_ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=query.device)
        part_acc = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32, device=query.device)
    else:
        part_ml = part_acc = out  # unused
    dummy = key_cache  # stands in for absent scales (QUANT == 0 never reads them)
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, splits)](
        query, key_cache, value_cache, k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy, out, part_ml, part_acc,
        block_table, query_start_loc, seq_lens, q_block_seq,
        scale if softcap is not None else scale * _LOG2E, sliding_window or 0, float(softcap or 1.0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        num_kv_heads, group, head_dim, block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d, NUM_SPLITS=splits,
        QUANT=MODES[mode], USE_WINDOW=sliding_window is not None,
        FP32_DOT=_fp32_dot(query, key_cache), USE_SOFTCAP=softcap is not None,
    )
    if splits > 1:
        block_s = triton.next_power_of_2(splits)
        num_rows = num_tokens * num_heads
        if query.device.type == "cuda":
            block_r = max(1, 2048 // (block_s * block_d))  # (token, head) rows per program: 2048-element tiles
        else:  # the interpreter: per-program overhead dominates, so few large programs
            block_r = triton.next_power_of_2(min(num_rows, 256))
        _reduce_splits_kernel[(triton.cdiv(num_rows, block_r),)](
            part_ml, part_acc, out, out.stride(0), out.stride(1), num_rows, num_heads, head_dim,
            NUM_SPLITS=splits, BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_D=block_d)
    return out
