"""The stacked adapter weights on the device, and the per-step batch the decoder applies them with.

Per layer and projection (core/lora/peft.py, PROJECTIONS): A [max_loras, S * R, in] and B
transposed, [max_loras, S * R, out], R = max_lora_rank, S the parts of a fused projection (3 for
qkv, 2 for gate_up). Part s of an adapter takes rows [s*R, s*R + r) of its slot's A and of B, the
latter over its own output columns only, so one shrink and one expand cover q, k and v at once (B
is block diagonal); a smaller rank leaves zeros, which add nothing. A slot holds one adapter; a
request of slot -1 runs the base model.

Residency is LRU over the slots: a step's adapters are loaded into the slots whose adapters that
step does not use, the least recently used first. The scheduler never puts more than max_loras
distinct adapters into one step (core/scheduler.py), so a step always finds its slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from pagedserve.core.lora.peft import PROJECTIONS, LoRAWeights, ProjectionShape
from pagedserve.kernels.reference.lora import SlotGroups, make_slot_groups
from pagedserve.kernels.reference.lora import lora_add as reference_lora_add


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """One step's adapter assignment (ForwardBatch.lora): which slot each row uses."""

    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    """Per layer: projection -> (stacked A, stacked B)."""
    token_slots: torch.Tensor
    """int32 [num_tokens]: the slot of each row, -1 for the base model."""
    groups: dict[str, SlotGroups]
    """Per projection some adapter of the step changes: the rows of each slot that changes it."""
    kernel: Callable[..., None]
    out_slices: dict[str, tuple[int, ...]]
    """Per projection: where each part's output rows start, and the end (kernels/reference/lora.py)."""

    def add(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter update of `projection` in `layer` for input x (in place)."""
        groups = self.groups.get(projection)
        if groups is not None:
            a, b = self.weights[layer][projection]
            self.kernel(y, x, a, b, self.token_slots, groups, self.out_slices[projection])


class LoRASlots:
    def __init__(self, shapes: dict[str, ProjectionShape], num_layers: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, kernels: ModuleType,
                 load: Callable[[int], LoRAWeights]) -> None:
        """load(lora_id): the adapter's weights on the host (core/lora/manager.py)."""
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.load = load
        self.kernel = getattr(kernels, "lora_add", reference_lora_add)
        self.out_slices = {p: tuple(o for o, _ in s.slices) + (s.out_features,) for p, s in shapes.items()}
        self.weights = [
            {p: (torch.zeros(max_loras, len(s.slices) * max_rank, s.in_features, dtype=dtype, device=device),
                 torch.zeros(max_loras, len(s.slices) * max_rank, s.out_features, dtype=dtype, device=device))
             for p, s in shapes.items()}
            for _ in range(num_layers)]
        self.resident: list[int | None] = [None] * max_loras
        """slot -> lora_id held there"""
        self.projections: list[frozenset[str]] = [frozenset()] * max_loras
        """slot -> projections its adapter changes"""
        self.last_used = [0] * max_loras
        self._clock = 0
        self.num_loads = 0
        """Adapters copied into a slot so far (tests and benchmarks see the evictions)."""

    def slots_for(self, lora_ids: set[int]) -> dict[int, int]:
        """lora_id -> slot for every adapter of a step, loading the missing ones over the least
        recently used slots the step does not need."""
        if len(lora_ids) > len(self.resident):
            raise RuntimeError(f"{len(lora_ids)} adapters in one step, more than max_loras={len(self.resident)}")
        self._clock += 1
        where = {lora_id: slot for slot, lora_id in enumerate(self.resident) if lora_id in lora_ids}
        for lora_id in sorted(lora_ids - set(where)):
            free = [s for s in range(len(self.resident)) if s not in where.values()]
            slot = min(free, key=lambda s: (self.resident[s] is not None, self.last_used[s]))
            self._fill(slot, lora_id)
            where[lora_id] = slot
        for slot in where.values():
            self.last_used[slot] = self._clock
        return where

    def forget(self, lora_id: int) -> None:
        """An adapter removed for good: its slot is free for the next one."""
        for slot, held in enumerate(self.resident):
            if held == lora_id:
                self.resident[slot], self.projections[slot], self.last_used[slot] = None, frozenset(), 0

    def _fill(self, slot: int, lora_id: int) -> None:
        weights = self.load(lora_id)
        for layer in self.weights:
            for a, b in layer.values():
                a[slot].zero_()
                b[slot].zero_()
        r_max = self.max_rank
        for piece in weights.pieces:
            a, b = self.weights[piece.layer][piece.projection]
            r = piece.a.shape[0]
            cols = slice(piece.slice * r_max, piece.slice * r_max + r)
            a[slot, cols].copy_(piece.a)
            b[slot, cols, piece.out_offset : piece.out_offset + piece.b.shape[0]].copy_(piece.b.T)
        self.resident[slot], self.projections[slot] = lora_id, weights.projections
        self.num_loads += 1

    def batch(self, lora_ids: np.ndarray, q_lens: np.ndarray) -> LoRABatch | None:
        """The step's LoRABatch for requests with these adapters (0: the base model) and query
        lengths; None when no request of the step uses an adapter."""
        present = set(np.unique(lora_ids).tolist()) - {0}
        if not present:
            return None
        where = self.slots_for(present)
        slot_of_request = np.array([where.get(i, -1) for i in lora_ids.tolist()], dtype=np.int32)
        token_slots = torch.from_numpy(np.repeat(slot_of_request, q_lens))
        groups: dict[str, SlotGroups] = {}
        made: dict[tuple[int, ...], SlotGroups] = {}  # projections changed by the same slots share one
        for p in PROJECTIONS:
            slots = tuple(sorted(s for s in where.values() if p in self.projections[s]))
            if slots and slots not in made:
                made[slots] = self._on_device(make_slot_groups(token_slots, slots, len(self.resident), self.dtype))
            if slots:
                groups[p] = made[slots]
        return LoRABatch(self.weights, token_slots.to(self.device), groups, self.kernel, self.out_slices)

    def _on_device(self, g: SlotGroups) -> SlotGroups:
        if self.device.type == "cpu":
            return g
        def dev(t):
            return None if t is None else t.to(self.device, non_blocking=True)
        return SlotGroups(g.slots, dev(g.slot_index), dev(g.rows), dev(g.pad))
