"""ForwardBatch: everything one forward pass needs, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.core.lora.slots import LoRABatch


@dataclass(frozen=True, slots=True)
class SampledRows:
    """The requests whose last row is a logits row, when those rows are all the logits rows and
    some rows are not (a prefill chunk among them, no prompt logprobs): the last layer then attends,
    projects and normalises only these rows (the others only leave their K and V in the cache),
    as decode rows of these requests."""

    block_tables: tuple[torch.Tensor, ...]
    """Per layer group, the rows of its block table of these requests, in logits row order."""
    query_start_loc: torch.Tensor
    """int32 [n + 1]: 0 .. n, one query row each."""
    seq_lens: torch.Tensor
    """int32 [n]: their seq_lens."""
    max_seq_len: int


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """A packed varlen batch: the scheduled tokens of B requests laid end to end (no padding).

    input_ids, positions, slot_mapping: [num_tokens]; query_start_loc: int32 [B + 1];
    seq_lens: int32 [B], tokens in the cache after this step; block_table: int32 [B, max_blocks]
    (of layer group 0; the other groups' are in group_tables);
    logits_indices: int64 [num_sampled], the rows whose logits are needed (each request's last
    token when it samples). max_query_len / max_seq_len are host ints so kernels never sync.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    max_seq_len: int
    rope_lengths: torch.Tensor | None = None
    """int64 [num_tokens]: max(the token's request's prompt length, position + 1), the sequence
    length transformers computes a length-dependent rope (longrope, dynamic NTK) for; None for the
    other rope types (core/layers/rotary.py)."""
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    """(block_table, slot_mapping) of layer groups 1.. (core/kv_cache/layout.py); block_table and
    slot_mapping above are group 0's. Empty for a model with one group."""

    lora: "LoRABatch | None" = None
    """Each row's LoRA adapter slot and the stacked weights (core/lora/slots.py); None when no
    request of the step uses an adapter."""

    sampled: SampledRows | None = None
    """Where the last layer may skip the rows no logits are taken from (SampledRows); None: it
    computes every row."""

    def cache_indexing(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table and slot mapping of a layer group."""
        return (self.block_table, self.slot_mapping) if group == 0 else self.group_tables[group - 1]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
