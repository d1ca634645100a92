"""Pure-torch paged-attention kernels: the CPU path of the engine and the oracle for Triton.

Cache layout (shared with the Triton twins): ``key_cache`` / ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous; token slot
``s = block_id * block_size + offset`` is row ``s`` of the cache viewed as
``[num_blocks * block_size, num_kv_heads, head_dim]``.

Performance notes (2-core AVX2 CPU, measured; see the kernel docstrings):

* Everything is gathered token-wise with ``index_select`` on the flattened cache and computed in
  fp32 (fp32 GEMMs are several times faster than bf16 here, and the softmax must be fp32 anyway).
* Decode rows (q_len == 1) are batched: sorted by the number of keys they read and cut into
  groups of about ``_DECODE_GROUP_TOKENS`` gathered tokens. Sorting keeps padding small; small
  groups keep the gathered K/V in cache and below glibc's mmap threshold (a fresh 40 MB buffer
  per call costs more in page faults than the copy itself).
* Prefill rows (q_len > 1) are few per step; each sequence gets one SDPA call with ``is_causal``
  when there is no cached prefix and no window, else SDPA calls over tiles of query rows with an
  explicit causal-with-offset mask (a tile only sees keys up to its last row). CPU SDPA needs
  4-D operands to take its flash kernel; ``enable_gqa`` avoids repeating K/V per query head.
* Padded key positions are clamped to a real slot of the same sequence, so stale or NaN values in
  unused cache slots never reach the arithmetic (masked-out scores times NaN would still be NaN).
* Quantized caches (int8, fp8; see pagedserve.kernels.kv_quant) are dequantized after the gather:
  only the gathered tokens are ever widened to fp32, never the whole cache. Float caches take the
  same path as before (gather, then ``.float()``), so quantization costs them nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels import contract
from pagedserve.kernels.reference.quant import dequantize_kv, quantize_kv

__all__ = ["reshape_and_cache", "paged_attention", "check_paged_attention_args", "prefill_attention"]

# Gathered key tokens per decode group (rows * padded keys): 4096 tokens of SmolLM2-sized K/V
# (3 kv heads x 64 x fp32) is 3 MiB per tensor. 2048..4096 measured best, 64k+ is 3x slower.
_DECODE_GROUP_TOKENS = 4096
# Query rows per SDPA call when a prefill chunk follows a cached prefix: an explicit mask stops
# SDPA from skipping the masked upper triangle, so tiling the rows skips most of it instead.
_PREFILL_QUERY_TILE = 128

def reshape_and_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
) -> None:
    """Store this step's K/V into the paged caches, in place (quantizing on write).

    key, value:   [num_tokens, num_kv_heads, head_dim], fp32/bf16/fp16 (cast to the cache dtype).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same dtype:
                  fp32/bf16/fp16, or int8/float8_e4m3fn/float8_e5m2 (quantized).
    slot_mapping: int64 [num_tokens]; token i goes to slot ``slot_mapping[i]`` =
                  ``block_id * block_size + offset_in_block``. Slots must be unique and in range
                  (no negative "skip" slots); every other slot is left untouched.
    k_scale, v_scale: None for a float cache. For a quantized cache either bf16
                  [num_blocks, block_size, num_kv_heads] (dynamic: this call writes the new tokens'
                  scales at their slots) or fp32 0-dim (static per-tensor: read only).
    """
    mode = contract.check_kv_store_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _, _, num_kv_heads, head_dim = key_cache.shape
    if mode == "none":
        # view() (not flatten/reshape) so a layout that cannot be written through fails loudly.
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))
        return
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        codes, new_scale = quantize_kv(x, cache.dtype, scale if mode == "static" else None)
        # CPU index_copy_ has no fp8 kernel: move the codes as bytes (same size, same layout).
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, codes.view(torch.uint8))
        if mode == "dynamic":
            scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, new_scale)


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention of a packed varlen batch over the paged KV cache.

    query:           [num_tokens, num_heads, head_dim]; num_heads = num_kv_heads * group (GQA).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same dtype.
    block_table:     int32 [B, max_blocks_per_seq]; entries past a sequence's blocks are ignored.
    query_start_loc: int32 [B + 1]; sequence b owns query rows query_start_loc[b]:query_start_loc[b+1]
                     (q_len may be 0). query_start_loc[B] == num_tokens.
    seq_lens:        int32 [B]; tokens of sequence b in the cache, this step's included. Query row q
                     of sequence b sits at position seq_lens[b] - q_len_b + q and attends to cache
                     positions [0, pos], or (pos - sliding_window, pos] with a window.
    max_query_len, max_seq_len: batch maxima (validated here; the Triton twin sizes its grid by them).
    k_scale, v_scale: as for reshape_and_cache (None for a float cache; per-slot or 0-dim for a
                     quantized one); gathered K/V are dequantized as ``code * scale``.
    softcap:         None, or c > 0: scores (scaled) become ``tanh(s / c) * c`` before the mask and
                     the softmax (Gemma 2's attention logit softcapping).
    Returns [num_tokens, num_heads, head_dim] in query's dtype; scores and softmax in fp32.
    """
    starts, lens, q_lens, mode = check_paged_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_query_len, max_seq_len,
        sliding_window, k_scale, v_scale, softcap)
    out = torch.empty_like(query)
    k_src, v_src = _sources(key_cache, value_cache, k_scale, v_scale, mode)
    decodes = [b for b in range(len(lens)) if q_lens[b] == 1]
    if decodes:
        _decode_attention(query, k_src, v_src, block_table, key_cache.shape[1], starts, lens, decodes,
                          scale, sliding_window, out, softcap)
    _prefill_rows(query, k_src, v_src, block_table, key_cache.shape[1], starts, lens, q_lens, scale,
                  sliding_window, out, softcap=softcap)
    return out


def check_paged_attention_args(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                               max_query_len, max_seq_len, sliding_window, k_scale, v_scale, softcap=None
                               ) -> tuple[list[int], list[int], list[int], str]:
    """Assert paged_attention's contract (pagedserve.kernels.contract, plus what the metadata's
    values must satisfy); return (query starts, seq_lens, q_lens) as lists and the scale mode.
    The CPU path reads the (tiny) metadata on the host; the Triton twin never does."""
    mode = contract.check_paged_attention_args(query, key_cache, value_cache, block_table, query_start_loc,
                                               seq_lens, max_seq_len, sliding_window, k_scale, v_scale, softcap)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    assert starts[0] == 0 and starts[-1] == query.shape[0], "query_start_loc must run from 0 to num_tokens"
    assert all(0 <= q <= s for q, s in zip(q_lens, lens)), "need 0 <= q_len <= seq_len for every sequence"
    assert max(q_lens, default=0) <= max_query_len, f"max_query_len={max_query_len} < {max(q_lens)}"
    assert max(lens, default=0) <= max_seq_len, f"max_seq_len={max_seq_len} < {max(lens)}"
    return starts, lens, q_lens, mode


def prefill_attention(query, key_cache, value_cache, block_table, starts, lens, q_lens, mode, scale,
                      sliding_window, k_scale, v_scale, out, compute_dtype: torch.dtype = torch.float32,
                      softcap: float | None = None) -> None:
    """Fill ``out`` for the sequences with more than one query row; the other arguments as
    check_paged_attention_args returned them (its checks already ran). compute_dtype: the dtype
    SDPA runs in (fp32 here; kernels/cpu passes bf16 for bf16 queries over bf16 caches, where CPU
    flash attention accumulates in fp32 like Hugging Face's bf16 SDPA, 2.5-3x faster)."""
    k_src, v_src = _sources(key_cache, value_cache, k_scale, v_scale, mode)
    _prefill_rows(query, k_src, v_src, block_table, key_cache.shape[1], starts, lens, q_lens, scale,
                  sliding_window, out, compute_dtype, softcap)


def _sources(key_cache, value_cache, k_scale, v_scale, mode) -> tuple[tuple, tuple]:
    """(k_src, v_src), each (flat cache, flat per-slot scales | 0-dim scale | None): see _gather."""
    num_kv_heads, head_dim = key_cache.shape[2:]

    def flat_scale(scale: Tensor | None) -> Tensor | None:
        return scale.view(-1, num_kv_heads) if mode == "dynamic" else scale

    return ((key_cache.view(-1, num_kv_heads, head_dim), flat_scale(k_scale)),
            (value_cache.view(-1, num_kv_heads, head_dim), flat_scale(v_scale)))


def _prefill_rows(query, k_src, v_src, block_table, block_size, starts, lens, q_lens, scale, sliding_window,
                  out, compute_dtype=torch.float32, softcap=None) -> None:
    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            _prefill_attention(query, k_src, v_src, block_table[b], block_size, starts[b], q_len,
                               lens[b], scale, sliding_window, out, compute_dtype, softcap)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None,
            is_causal: bool = False) -> Tensor:
    """SDPA over [.., Hq, Lq, D] queries and [.., Hkv, Lk, D] keys/values (GQA: query head h reads
    KV head h // (Hq // Hkv)); mask: bool, True = attend. With a softcap SDPA cannot be used (it
    has no hook between the scores and the softmax), so the scores are formed explicitly, capped
    as transformers' eager attention does (scale, / c, tanh, * c), masked and softmaxed in fp32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _gather(src: tuple[Tensor, Tensor | None], slots: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """K or V of cache ``slots`` ([n] int64) -> [n, num_kv_heads, head_dim] in ``dtype``, dequantized
    (in fp32) if needed."""
    flat, scale = src
    x = flat.index_select(0, slots)
    if scale is None:
        return x.to(dtype)
    return dequantize_kv(x, scale if scale.dim() == 0 else scale.index_select(0, slots)).to(dtype)


def _slots(block_table: Tensor, block_size: int, positions: Tensor) -> Tensor:
    """Cache slots (int64) of token ``positions`` ([..., L]) through ``block_table`` rows ([..., max_blocks])."""
    blocks = torch.gather(block_table, -1, positions // block_size).long()
    return blocks * block_size + positions % block_size


def _decode_attention(query, k_src, v_src, block_table, block_size, starts, lens, decodes,
                      scale, sliding_window, out, softcap=None) -> None:
    """One query row per sequence: batched gather + one SDPA per group of similar-length rows."""
    num_kv_heads, head_dim = k_src[0].shape[1:]
    group = query.shape[1] // num_kv_heads
    # Keys each row reads: its whole context, or the last `sliding_window` positions.
    n_keys = {b: lens[b] if sliding_window is None else min(lens[b], sliding_window) for b in decodes}
    order = sorted(decodes, key=n_keys.__getitem__, reverse=True)
    device = query.device
    i = 0
    while i < len(order):
        width = n_keys[order[i]]  # longest in this group, since sorted descending
        rows = order[i:i + max(1, _DECODE_GROUP_TOKENS // width)]
        i += len(rows)
        seq_idx, q_rows, last, n = torch.tensor(
            [rows, [starts[b] for b in rows], [lens[b] - 1 for b in rows], [n_keys[b] for b in rows]],
            dtype=torch.long, device=device)
        last, n = last[:, None], n[:, None]
        offs = torch.arange(width, device=device)[None, :]
        # Padded columns clamp to the row's last real position: finite data, masked out below.
        positions = torch.minimum(last - n + 1 + offs, last)
        slots = _slots(block_table.index_select(0, seq_idx), block_size, positions).view(-1)
        k = _gather(k_src, slots).view(len(rows), width, num_kv_heads, head_dim)
        v = _gather(v_src, slots).view(len(rows), width, num_kv_heads, head_dim)
        # [G, Hkv, group, D]: the group's heads become the query-length axis, so K/V are not repeated.
        q = query.index_select(0, q_rows).view(len(rows), num_kv_heads, group, head_dim)
        ragged = n_keys[rows[-1]] < width
        mask = (offs < n)[:, None, None, :] if ragged else None
        o = _attend(q.float(), k.transpose(1, 2), v.transpose(1, 2), mask, scale, softcap)
        out.index_copy_(0, q_rows, o.reshape(len(rows), -1, head_dim).to(out.dtype))


def _prefill_attention(query, k_src, v_src, block_row, block_size, q_start, q_len, seq_len,
                       scale, sliding_window, out, compute_dtype=torch.float32, softcap=None) -> None:
    """Several query rows of one sequence (a prompt or a prefill chunk after a cached prefix)."""
    context = seq_len - q_len  # tokens cached before this step
    # First key any query row can see; positions before it are never gathered.
    kv_start = 0 if sliding_window is None else max(0, context + 1 - sliding_window)
    key_pos = torch.arange(kv_start, seq_len, device=query.device)
    slots = _slots(block_row, block_size, key_pos)
    # 4-D operands: 3-D ones send CPU SDPA down its slow math path (measured ~6x slower).
    k = _gather(k_src, slots, compute_dtype).transpose(0, 1)[None]  # [1, Hkv, n, D]
    v = _gather(v_src, slots, compute_dtype).transpose(0, 1)[None]
    q = query[q_start:q_start + q_len].to(compute_dtype).transpose(0, 1)[None]  # [1, H, q_len, D]
    if context == 0 and sliding_window is None:
        o = _attend(q, k, v, None, scale, softcap, is_causal=True)
        out[q_start:q_start + q_len] = o[0].transpose(0, 1).to(out.dtype)
        return
    q_pos = torch.arange(context, seq_len, device=query.device)[:, None]
    mask = key_pos[None, :] <= q_pos
    if sliding_window is not None:
        mask &= key_pos[None, :] > q_pos - sliding_window
    for i0 in range(0, q_len, _PREFILL_QUERY_TILE):
        i1 = min(q_len, i0 + _PREFILL_QUERY_TILE)
        # Keys this tile can see: from its first row's window start up to its last row.
        lo = 0 if sliding_window is None else max(0, context + i0 + 1 - sliding_window) - kv_start
        hi = context + i1 - kv_start
        o = _attend(q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi], mask[i0:i1, lo:hi], scale, softcap)
        out[q_start + i0:q_start + i1] = o[0].transpose(0, 1).to(out.dtype)
