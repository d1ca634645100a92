"""Multi-LoRA's per-row adapter update on the GPU: y[t] += (x[t] @ A[s].T) @ B[s] for
s = token_slots[t] >= 0. Twin of pagedserve.kernels.reference.lora.lora_add (same signature, same
contract); the runner passes groups=None (lora_needs_groups), since each row reads its own slot.

Two launches, BGMV-style (one program per row and block of columns, as punica's decode kernels):

* shrink: program (row, rank block) writes shrunk[t, j] = A[s, j, :] . x[t] in fp32 for the
  S * R ranks of the slot (S parts of a fused projection), looping over `in` in BLOCK_K steps.
* expand: program (row, output block) adds to y[t, o] the sum over the R ranks of o's part only:
  B is block diagonal (part p's outputs read ranks [p R, (p + 1) R)), so the zeros are never read.
  The part of each output column is found from the part boundaries (at most three parts: qkv),
  so an output block may straddle two parts.

Rows of slot -1 (the base model) exit at once and y keeps its exact values. The shrink stays in
fp32 between the launches and y is rounded once, as the C++ kernel does (the reference rounds
the shrink to bf16 in bf16, so the two differ by that rounding). A row's work is ~ (in + out) * S R
multiply-adds, small beside the layer's matmul; grouping rows by adapter (SGMV with tl.dot) is the
lever for long prefills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.reference.lora import SlotGroups, check_lora_args

__all__ = ["lora_add", "lora_needs_groups"]

BLOCK_K = 64    # `in` values per shrink step
BLOCK_J = 16    # ranks per shrink program
BLOCK_O = 64    # output columns per expand program
MAX_PARTS = 3   # q, k, v of a fused qkv projection


def lora_needs_groups() -> bool:
    """The kernel reads token_slots per row: the runner need not build SlotGroups."""
    return False


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, shrunk_ptr, n_in, ranks,
                        BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        jmask = j < ranks
        acc = tl.zeros([BLOCK_J], dtype=tl.float32)
        a_rows = a_ptr + (s.to(tl.int64) * ranks + j[:, None]) * n_in
        x_row = x_ptr + t.to(tl.int64) * n_in
        for k0 in range(0, n_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < n_in
            xv = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
            av = tl.load(a_rows + k[None, :], mask=jmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(shrunk_ptr + t.to(tl.int64) * ranks + j, acc, mask=jmask)


@triton.jit
def _lora_expand_kernel(y_ptr, b_ptr, slots_ptr, shrunk_ptr, n_out, ranks, start1, start2,
                        R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        omask = o < n_out
        # start1 / start2: where parts 1 and 2 begin (n_out where there is no such part).
        part = (o >= start1).to(tl.int32) + (o >= start2).to(tl.int32)
        r = tl.arange(0, BLOCK_R)
        k = part[None, :] * R + r[:, None]  # [BLOCK_R, BLOCK_O]: the rank each (r, o) reads
        mask = (r[:, None] < R) & omask[None, :]
        bv = tl.load(b_ptr + (s.to(tl.int64) * ranks + k) * n_out + o[None, :], mask=mask, other=0.0)
        sv = tl.load(shrunk_ptr + t.to(tl.int64) * ranks + k, mask=mask, other=0.0)
        delta = tl.sum(bv.to(tl.float32) * sv, axis=0)
        y_row = y_ptr + t.to(tl.int64) * n_out + o
        yv = tl.load(y_row, mask=omask, other=0.0)
        tl.store(y_row, (yv.to(tl.float32) + delta).to(yv.dtype), mask=omask)


def lora_add(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor,
             groups: SlotGroups | None, out_slices: tuple[int, ...]) -> None:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s] for s = token_slots[t] >= 0, in place (see the
    reference for the arguments; `groups` is not read)."""
    check_lora_args(y, x, lora_a, lora_b, token_slots)
    parts = len(out_slices) - 1
    rows, n_in = x.shape
    n_out, ranks = y.shape[1], lora_a.shape[1]
    if not 1 <= parts <= MAX_PARTS or ranks % parts or out_slices[0] != 0 or out_slices[-1] != n_out:
        raise ValueError(f"lora_add: out_slices {out_slices} must run from 0 to {n_out} in 1-{MAX_PARTS} parts "
                         f"that divide the rank {ranks}")
    if rows == 0:
        return
    assert y.is_contiguous() and lora_a.is_contiguous() and lora_b.is_contiguous(), "contiguous y, A, B only"
    x = x.contiguous()
    slots = token_slots.to(device=x.device, dtype=torch.int32).contiguous()
    r = ranks // parts
    starts = list(out_slices[1:-1]) + [n_out] * (MAX_PARTS - parts)
    shrunk = torch.empty(rows, ranks, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(rows, triton.cdiv(ranks, BLOCK_J))](x, lora_a, slots, shrunk, n_in, ranks,
                                                              BLOCK_J=BLOCK_J, BLOCK_K=BLOCK_K)
    _lora_expand_kernel[(rows, triton.cdiv(n_out, BLOCK_O))](y, lora_b, slots, shrunk, n_out, ranks, starts[0],
                                                              starts[1], R=r, BLOCK_R=triton.next_power_of_2(r),
                                                              BLOCK_O=BLOCK_O)
