"""Multi-LoRA: each row of a batch adds its own adapter's low-rank update (the oracle of the other
backends' lora_add, and the CPU fallback).

SGMV in plain torch: the rows of one adapter slot are gathered and go through two matmuls (shrink
to the rank, expand to the output), one pair per slot present in the batch, never a loop per row.
Rows of slot -1 (the base model) are in no group and left alone.
"""

from __future__ import annotations

from torch import Tensor

SlotRows = tuple[tuple[int, "Tensor | None"], ...]
"""(slot, int64 row indices of that slot, or None when every row is that slot's), per slot present."""


def check_lora_args(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> None:
    """Shapes every lora_add implementation asserts: x [T, in], y [T, out], lora_a [L, R, in],
    lora_b [L, out, R], token_slots int32 [T] in [-1, L)."""
    assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0], f"x {tuple(x.shape)} / y {tuple(y.shape)}"
    assert lora_a.dim() == 3 and lora_b.dim() == 3, f"lora_a {tuple(lora_a.shape)} / lora_b {tuple(lora_b.shape)}"
    assert lora_a.shape[0] == lora_b.shape[0] and lora_a.shape[1] == lora_b.shape[2], "A/B slots or ranks differ"
    assert lora_a.shape[2] == x.shape[1] and lora_b.shape[1] == y.shape[1], "A/B do not fit x/y"
    assert token_slots.shape == (x.shape[0],), f"token_slots {tuple(token_slots.shape)} for {x.shape[0]} rows"
    assert x.dtype == y.dtype == lora_a.dtype == lora_b.dtype, "x, y, A, B must share a dtype"


def lora_add(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor, slot_rows: SlotRows) -> None:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for s = token_slots[t] >= 0, in place.
    slot_rows: the same assignment grouped by slot (built once per step by the runner)."""
    for slot, rows in slot_rows:
        if rows is None:
            y.add_((x @ lora_a[slot].T) @ lora_b[slot].T)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T)
