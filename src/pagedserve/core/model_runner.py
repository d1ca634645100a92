"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> logits -> Sampler.

Owns the model, the paged KV cache tensors, the sampler and its persistent batch (core/runner_batch.py:
each live sample's block tables and output history, kept from the scheduler's step deltas). Batch
metadata is built with numpy on the host (a loop per sample, never per token or per block) and
copied to the device once per step.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.core.forward_batch import ForwardBatch, SampledRows
from pagedserve.core.kv_cache.cache_tensors import KVCacheSpec, allocate_kv_caches
from pagedserve.core.kv_cache.layout import KVCacheLayout
from pagedserve.core.lora.slots import LoRASlots
from pagedserve.core.models.llama import LlamaDecoder
from pagedserve.core.outputs import TokenLogprobs
from pagedserve.core.runner_batch import RunnerBatch, RunnerSample
from pagedserve.core.sampler import Sampler, compute_logprobs
from pagedserve.core.step_types import RunnerOutput, ScheduledSample, SchedulerOutput
from pagedserve.core.structured_output.manager import GrammarBitmask


class ModelRunner:
    def __init__(self, model: LlamaDecoder, num_blocks: int, block_size: int, kv_spec: KVCacheSpec,
                 layout: KVCacheLayout | None = None, lora: LoRASlots | None = None) -> None:
        """kv_spec: the cache's dtype, scales and layout (core/kv_cache/cache_tensors.py);
        layout: the layer groups, each with its own block table (None: one group);
        lora: the stacked LoRA adapter weights (None: LoRA off)."""
        self.model = model
        self.lora = lora
        self.block_size = block_size
        self.device = model.device
        assert kv_spec.block_size == block_size, f"kv_spec.block_size={kv_spec.block_size} != {block_size}"
        self.kv_spec = kv_spec
        self.kv_caches = allocate_kv_caches(kv_spec, num_blocks, self.device, layout)
        self.num_groups = layout.num_groups if layout is not None else 1
        self.batch = RunnerBatch(self.num_groups, null_block_id=num_blocks)
        """The samples this runner holds (the null block is the cache tensors' extra row, num_blocks)."""
        self.sampler = Sampler(getattr(model.kernels, "argmax_rows", None))

    def forget_all(self) -> None:
        """Drop every sample's state (after a failed step: the scheduler has finished them all, and
        the runner may have missed that step's delta)."""
        self.batch.clear()

    def prepare(self, scheduled: tuple[ScheduledSample, ...], samples: list[RunnerSample]) -> ForwardBatch:
        reqs = scheduled
        q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((r.start_position for r in reqs), dtype=np.int64, count=len(reqs))
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
        # position of token j = start of its sample + (j - first row of its sample)
        positions = np.repeat(starts - query_start_loc[:-1], q_lens) + np.arange(num_tokens)
        seq_lens = starts + q_lens
        row_of_token = np.repeat(np.arange(len(reqs)), q_lens)
        rows = np.fromiter((sample.row for sample in samples), dtype=np.int64, count=len(samples))
        block_table, slot_mapping = self._cache_indexing(rows, 0, row_of_token, positions)
        # Each sample needs the logits of its last k rows (k from _num_logits_rows).
        counts = np.fromiter((self._num_logits_rows(r, x) for r, x in zip(reqs, samples)), dtype=np.int64,
                             count=len(reqs))
        first_out = np.zeros(len(reqs), dtype=np.int64)
        np.cumsum(counts[:-1], out=first_out[1:])
        logits_indices = (np.repeat(query_start_loc[1:] - counts - first_out, counts)
                          + np.arange(int(counts.sum())))

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        rope_lengths = None
        if self.model.needs_rope_lengths:
            # Dynamic NTK: the prompt's length; longrope: the sample's whole current length
            # (core/layers/rotary.py says why).
            whole = self.model.rope_switch_length is not None
            lengths = np.fromiter((len(x.static.prompt_token_ids) + (len(x.output_token_ids) if whole else 0)
                                   for x in samples), dtype=np.int64, count=len(samples))
            rope_lengths = dev(np.maximum(np.repeat(lengths, q_lens), positions + 1))

        tables = [block_table]
        group_tables = ()
        if self.num_groups > 1:
            indexing = [self._cache_indexing(rows, g, row_of_token, positions) for g in range(1, self.num_groups)]
            tables += [table for table, _ in indexing]
            group_tables = tuple(tuple(map(dev, pair)) for pair in indexing)
        lora = None
        if self.lora is not None:
            lora_ids = np.fromiter((x.static.lora_id for x in samples), dtype=np.int64, count=len(samples))
            lora = self.lora.batch(lora_ids, q_lens)
        sampled = None
        num_sampled = len(logits_indices)
        if lora is None and counts.max(initial=0) <= 1 and 0 < num_sampled < num_tokens:
            # Each logits row is its request's last row: the last layer needs no other row.
            seqs = np.flatnonzero(counts)
            lens = seq_lens[seqs]
            sampled = SampledRows(block_tables=tuple(dev(table[seqs]) for table in tables),
                                  query_start_loc=dev(np.arange(num_sampled + 1, dtype=np.int32)),
                                  seq_lens=dev(lens.astype(np.int32)), max_seq_len=int(lens.max()))
        return ForwardBatch(
            input_ids=dev(input_ids),
            positions=dev(positions),
            query_start_loc=dev(query_start_loc.astype(np.int32)),
            seq_lens=dev(seq_lens.astype(np.int32)),
            block_table=dev(block_table),
            slot_mapping=dev(slot_mapping),
            logits_indices=dev(logits_indices),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            rope_lengths=rope_lengths,
            group_tables=group_tables,
            lora=lora,
            sampled=sampled,
        )

    def _cache_indexing(self, rows: np.ndarray, group: int, row_of_token: np.ndarray,
                        positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One layer group's block table [B, max_blocks] and the cache slot of every token."""
        block_table = self.batch.block_tables.gather(rows, group)
        slot_mapping = (
            block_table[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        return block_table, slot_mapping

    @staticmethod
    def _wants_prompt_logprobs(r: ScheduledSample, sample: RunnerSample) -> bool:
        static = sample.static
        return static.sampling_params.prompt_logprobs is not None and r.start_position < len(static.prompt_token_ids)

    def _num_logits_rows(self, r: ScheduledSample, sample: RunnerSample) -> int:
        """How many of the sample's last rows need logits: all of them while it scores its prompt
        (prompt_logprobs), else its last row when it samples, else none."""
        if self._wants_prompt_logprobs(r, sample):
            return len(r.token_ids)
        return 1 if r.sample else 0

    def execute(self, out: SchedulerOutput, grammar: GrammarBitmask | None = None) -> RunnerOutput:
        """Run one step: sampled tokens, their logprobs, and prompt logprobs where asked.
        grammar: the structured-output token masks of this step's constrained samples."""
        self.sampler.forget(out.finished_seq_ids)
        samples = self.batch.update(out)
        if out.is_empty:
            return RunnerOutput({}, {}, {})
        batch = self.prepare(out.scheduled, samples)
        if grammar is None and not any(self._wants_prompt_logprobs(r, x) for r, x in zip(out.scheduled, samples)):
            # Then the logits rows are the sampling rows, in order.
            sampling = [x for r, x in zip(out.scheduled, samples) if r.sample]
            if sampling and self.sampler.greedy_only([x.static.sampling_params for x in sampling],
                                                     [x.output_token_ids for x in sampling],
                                                     [x.static.eos_token_id for x in sampling]):
                tokens = self.model.greedy_tokens(batch, self.kv_caches, self.sampler.argmax_rows).tolist()
                return RunnerOutput(self._record(sampling, tokens), {}, {})
        logits = self.model.forward(batch, self.kv_caches)
        sample_rows, sampling, prompt_logprobs = [], [], {}
        row = 0
        for r, x in zip(out.scheduled, samples):
            n_rows = self._num_logits_rows(r, x)
            if self._wants_prompt_logprobs(r, x):
                prompt_logprobs[r.seq_id] = self._prompt_logprobs(r, x, logits[row : row + n_rows])
            if r.sample:
                sample_rows.append(row + n_rows - 1)
                sampling.append(x)
            row += n_rows
        if not sampling:
            return RunnerOutput({}, {}, prompt_logprobs)
        # Every row samples, in order: the logits themselves, not an 11 MB copy; unless a grammar
        # masks them in place (the forward's output is an inference tensor).
        if grammar is None and len(sample_rows) == logits.shape[0]:
            sample_logits = logits
        else:
            sample_logits = logits[torch.tensor(sample_rows, device=logits.device)]
        if grammar is not None:  # before the sampler: sampling and logprobs see the masked logits (as vLLM)
            grammar.apply(sample_logits, [x.static.seq_id for x in sampling])
        result = self.sampler(
            sample_logits, [x.static.seq_id for x in sampling], [x.static.sampling_params for x in sampling],
            [x.output_token_ids for x in sampling], [x.static.prompt_token_ids for x in sampling],
            [x.static.eos_token_id for x in sampling],
        )
        sampled = self._record(sampling, result.token_ids)
        logprobs = {x.static.seq_id: lp for x, lp in zip(sampling, result.logprobs) if lp is not None}
        return RunnerOutput(sampled, logprobs, prompt_logprobs)

    @staticmethod
    def _record(sampling: list[RunnerSample], token_ids: list[int]) -> dict[int, int]:
        """Append each sample's new token to the runner's own history (the scheduler appends the
        same token to its own); seq_id -> token."""
        for x, t in zip(sampling, token_ids):
            x.output_token_ids.append(t)
        return {x.static.seq_id: t for x, t in zip(sampling, token_ids)}

    @staticmethod
    def _prompt_logprobs(r: ScheduledSample, sample: RunnerSample, logits: torch.Tensor) -> list[TokenLogprobs]:
        """Row j scores the prompt token at position start + j + 1 (the next one), if any."""
        prompt = sample.static.prompt_token_ids
        targets = list(prompt[r.start_position + 1 : r.start_position + 1 + logits.shape[0]])
        if not targets:
            return []
        num_top = sample.static.sampling_params.prompt_logprobs
        return compute_logprobs(logits[: len(targets)], targets, [num_top] * len(targets))
