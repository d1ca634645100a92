"""Multi-LoRA's lora_add through the C++ kernel (lora.cpp) on CPUs with AVX-512: one call per
projection instead of the reference's five ops, and B's block-diagonal zeros skipped; bf16 on AMX
takes tile instructions (amx_lora.cpp) where `in` is a multiple of 32 and each part's rank of 16.
Same contract as pagedserve.kernels.reference.lora.lora_add (fp32 equal up to the order of the
sums; bf16 rounds once at the end where the reference rounds each op, and the vector kernel keeps
the shrink in fp32). Elsewhere: the reference."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.kernels.cpu.build import load_extension
from pagedserve.kernels.cpu.linear import avx512_available
from pagedserve.kernels.reference import lora as reference

__all__ = ["lora_add", "lora_needs_groups", "native_available"]

_DTYPES = (torch.float32, torch.bfloat16)


def native_available() -> bool:
    return avx512_available()


def lora_needs_groups() -> bool:
    """Whether lora_add needs its `groups` argument: only the reference does, and building them
    costs every step some torch ops; where the C++ kernel runs, the runner passes None."""
    return not native_available()


def lora_add(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor,
             groups: reference.SlotGroups | None, out_slices: tuple[int, ...]) -> None:
    if (x.device.type == "cpu" and x.dtype in _DTYPES and y.is_contiguous() and lora_a.is_contiguous()
            and lora_b.is_contiguous() and native_available()):
        load_extension().lora_add(y, x.contiguous(), lora_a, lora_b, token_slots, list(out_slices))
        return
    if groups is None:
        present = tuple(sorted(set(token_slots.tolist()) - {-1}))
        groups = reference.make_slot_groups(token_slots, present, lora_a.shape[0], x.dtype)
    reference.lora_add(y, x, lora_a, lora_b, token_slots, groups, out_slices)
