"""The runner's persistent batch: its own copy of every sample it runs, kept from the scheduler's
step deltas (core/step_types.py) instead of being sent whole each step.

A sample enters with its NewSample record (static data, the output tokens it already had) and
owns one row of the block tables until it finishes or is preempted (a preempted sample comes back
as a new one). Each step appends the sample's new block ids to its row, sets the leading entries a
sliding window has passed to the null block (as the KV cache manager's table has them), and the
runner appends the token it samples to the sample's output history. So a step's host work grows
with the batch, not with the samples' lengths, and the block table handed to the kernels is one
numpy gather: the same ids, widths and zero padding as a table built from whole lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pagedserve.core.step_types import NewSample, SchedulerOutput


@dataclass(slots=True, eq=False)
class RunnerSample:
    """What the runner keeps of one sample between steps."""

    static: NewSample
    """Its record as the scheduler sent it (prompt, sampling params, EOS id, ...), kept whole so
    that a field added there reaches the runner as is."""
    output_token_ids: list[int]
    """Its output so far: the NewSample's tokens, then every token the runner sampled for it
    (the sampler's penalties, min_tokens and bad_words read it)."""
    row: int
    """Its row in every group's block table."""
    num_null: list[int]
    """Per group: leading table entries already set to the null block."""


class BlockTables:
    """Per layer group an int32 table [rows, columns]; a sample owns the same row in every group.
    Entries past a row's length are zero, as the padding of a table built per step was."""

    def __init__(self, num_groups: int, null_block_id: int, rows: int = 16, columns: int = 64) -> None:
        self.null_block_id = null_block_id
        self.tables = [np.zeros((rows, columns), dtype=np.int32) for _ in range(num_groups)]
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._free_rows = list(range(rows - 1, -1, -1))

    def take_row(self) -> int:
        if not self._free_rows:
            rows, columns = self.tables[0].shape
            self._resize(2 * rows, columns)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        n = int(self.lengths[row])
        for table in self.tables:
            table[row, :n] = 0
        self.lengths[row] = 0
        self._free_rows.append(row)

    def append(self, row: int, group_block_ids: tuple[tuple[int, ...], ...]) -> None:
        n = len(group_block_ids[0])
        if not n:
            return
        start = int(self.lengths[row])
        rows, columns = self.tables[0].shape
        if start + n > columns:
            self._resize(rows, max(2 * columns, start + n))
        for table, ids in zip(self.tables, group_block_ids):
            table[row, start:start + n] = ids
        self.lengths[row] = start + n

    def set_null(self, row: int, group: int, start: int, stop: int) -> None:
        self.tables[group][row, start:stop] = self.null_block_id

    def gather(self, rows: np.ndarray, group: int) -> np.ndarray:
        """The group's block table [len(rows), longest of these rows] for a batch (a copy)."""
        width = int(self.lengths[rows].max())
        return self.tables[group][rows, :width]

    def row_ids(self, row: int, group: int) -> list[int]:
        return self.tables[group][row, : int(self.lengths[row])].tolist()

    def _resize(self, rows: int, columns: int) -> None:
        old_rows, old_columns = self.tables[0].shape
        for g, table in enumerate(self.tables):
            grown = np.zeros((rows, columns), dtype=np.int32)
            grown[:old_rows, :old_columns] = table
            self.tables[g] = grown
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[:old_rows] = self.lengths
        self.lengths = lengths


class RunnerBatch:
    """The samples the runner holds, by seq_id, and their block tables."""

    def __init__(self, num_groups: int, null_block_id: int) -> None:
        self.num_groups = num_groups
        self.samples: dict[int, RunnerSample] = {}
        self.block_tables = BlockTables(num_groups, null_block_id)

    def update(self, out: SchedulerOutput) -> list[RunnerSample]:
        """Apply one step's delta: drop finished and preempted samples, add new ones, extend the
        scheduled ones' tables. Returns the scheduled samples' records, in batch order."""
        self.drop(out.finished_seq_ids)
        self.drop(out.preempted_seq_ids)
        for new in out.new_samples:
            self._add(new)
        tables = self.block_tables
        batch = []
        for s in out.scheduled:
            sample = self.samples[s.seq_id]
            tables.append(sample.row, s.new_block_ids)
            for g, num_null in enumerate(s.num_null_blocks):
                if num_null > sample.num_null[g]:
                    tables.set_null(sample.row, g, sample.num_null[g], num_null)
                    sample.num_null[g] = num_null
            batch.append(sample)
        return batch

    def drop(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            sample = self.samples.pop(seq_id, None)
            if sample is not None:
                self.block_tables.release_row(sample.row)

    def clear(self) -> None:
        """Forget every sample (after a failed step, when the scheduler has dropped them all)."""
        self.drop(list(self.samples))

    def _add(self, new: NewSample) -> None:
        if new.seq_id in self.samples:
            raise RuntimeError(f"sample {new.seq_id} is new to the runner but it already holds it")
        self.samples[new.seq_id] = RunnerSample(new, list(new.output_token_ids), self.block_tables.take_row(),
                                                [0] * self.num_groups)
