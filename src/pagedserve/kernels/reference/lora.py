"""Multi-LoRA: each row of a batch adds its own adapter's low-rank update (the oracle of the other
backends' lora_add, and the CPU fallback).

SGMV in plain torch, a fixed handful of ops per call whatever the number of adapters: the rows of
each slot present are gathered into one padded [slots, rows, in] batch (built once per step,
SlotGroups), shrunk to the rank and expanded to the output by two batched matmuls, and added back
to their rows. Padding rows read row 0 and are zeroed after the shrink, so they add exact zeros.
Rows of slot -1 (the base model) are in no group and left alone. A per-slot loop measured 3x
slower on SmolLM2 (16 small ops per projection against 5: op overhead, not arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
import torch


@dataclass(frozen=True, slots=True)
class SlotGroups:
    """The rows of each adapter slot a step uses, in the padded form lora_add takes."""

    slots: tuple[int, ...]
    """The slots present, ascending."""
    slot_index: Tensor | None
    """int64 [G]: `slots` as a tensor, to gather their A/B; None when they are all slots in order."""
    rows: Tensor | None
    """int64 [G, max rows of a slot]: the rows of slot g, padded with row 0; None when one slot has every row."""
    pad: Tensor | None
    """[G, max rows, 1] in x's dtype: 1 for a real row, 0 for padding; None without padding."""


def check_lora_args(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> None:
    """Shapes every lora_add implementation asserts: x [T, in], y [T, out], lora_a [L, R, in],
    lora_b [L, R, out] (B transposed: each rank's output row contiguous), token_slots int32 [T] in [-1, L)."""
    assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0], f"x {tuple(x.shape)} / y {tuple(y.shape)}"
    assert lora_a.dim() == 3 and lora_b.dim() == 3, f"lora_a {tuple(lora_a.shape)} / lora_b {tuple(lora_b.shape)}"
    assert lora_a.shape[:2] == lora_b.shape[:2], "A/B slots or ranks differ"
    assert lora_a.shape[2] == x.shape[1] and lora_b.shape[2] == y.shape[1], "A/B do not fit x/y"
    assert token_slots.shape == (x.shape[0],), f"token_slots {tuple(token_slots.shape)} for {x.shape[0]} rows"
    assert x.dtype == y.dtype == lora_a.dtype == lora_b.dtype, "x, y, A, B must share a dtype"


def lora_add(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor, groups: SlotGroups,
             out_slices: tuple[int, ...]) -> None:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s] for s = token_slots[t] >= 0, in place.
    groups: the same assignment grouped by slot (built once per step by the runner).
    out_slices: the output rows where each part of a fused projection starts, and its end
    ((0, q, q + kv, q + 2 kv) for qkv): part i reads only ranks [i R, (i + 1) R) of B, the rest of
    B's rows being zero there (block diagonal). The reference multiplies the zeros; C++ skips them."""
    if groups.rows is None:
        s = groups.slots[0]
        y.add_((x @ lora_a[s].T) @ lora_b[s])
        return
    if groups.slot_index is not None:
        lora_a, lora_b = lora_a.index_select(0, groups.slot_index), lora_b.index_select(0, groups.slot_index)
    shrunk = torch.bmm(x[groups.rows], lora_a.transpose(1, 2))
    if groups.pad is not None:
        shrunk.mul_(groups.pad)
    expanded = torch.bmm(shrunk, lora_b)
    y.index_add_(0, groups.rows.view(-1), expanded.view(-1, y.shape[1]))


def make_slot_groups(token_slots: Tensor, slots: tuple[int, ...], num_slots: int, dtype: torch.dtype) -> SlotGroups:
    """SlotGroups for the rows of `slots` (ascending) among token_slots (host int tensor [T]);
    tensors on token_slots' device."""
    device = token_slots.device
    members = [torch.nonzero(token_slots == s).flatten() for s in slots]
    if len(slots) == 1 and members[0].numel() == token_slots.numel():
        return SlotGroups(slots, None, None, None)
    width = max(m.numel() for m in members)
    rows = torch.zeros(len(slots), width, dtype=torch.int64, device=device)
    pad = torch.zeros(len(slots), width, 1, dtype=dtype, device=device)
    for g, m in enumerate(members):
        rows[g, : m.numel()] = m
        pad[g, : m.numel()] = 1
    slot_index = None if slots == tuple(range(num_slots)) else torch.tensor(slots, dtype=torch.int64, device=device)
    padded = any(m.numel() < width for m in members)
    return SlotGroups(slots, slot_index, rows, pad if padded else None)
