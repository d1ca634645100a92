"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> logits -> Sampler.

Owns the model, the paged KV cache tensors and the sampler. Batch metadata is built with numpy
on the host (a loop per request, never per token) and copied to the device once per step.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.core.forward_batch import ForwardBatch
from pagedserve.core.models.llama import KVCacheTensors, LlamaDecoder
from pagedserve.core.sampler import Sampler
from pagedserve.core.scheduler import SchedulerOutput


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: LlamaDecoder, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.device
        arch = model.arch
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [
            KVCacheTensors(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=kv_dtype, device=self.device))
            for _ in range(arch.num_layers)
        ]
        self.sampler = Sampler()

    def prepare(self, out: SchedulerOutput) -> ForwardBatch:
        reqs = out.requests
        q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((r.start_position for r in reqs), dtype=np.int64, count=len(reqs))
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
        # position of token j = start of its request + (j - first row of its request)
        positions = np.repeat(starts - query_start_loc[:-1], q_lens) + np.arange(num_tokens)
        seq_lens = starts + q_lens
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_table = np.zeros((len(reqs), max_blocks), dtype=np.int32)
        for i, r in enumerate(reqs):
            block_table[i, : len(r.block_ids)] = r.block_ids
        row_of_token = np.repeat(np.arange(len(reqs)), q_lens)
        slot_mapping = (
            block_table[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        sample_mask = np.fromiter((r.sample for r in reqs), dtype=bool, count=len(reqs))
        logits_indices = query_start_loc[1:][sample_mask] - 1

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

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
        )

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one step; return request_id -> sampled token for requests that sample."""
        self.sampler.forget(out.finished_request_ids)
        if out.is_empty:
            return {}
        batch = self.prepare(out)
        logits = self.model.forward(batch, self.kv_caches)
        sampling = [r for r in out.requests if r.sample]
        if not sampling:
            return {}
        tokens = self.sampler(logits, [r.request_id for r in sampling], [r.sampling_params for r in sampling])
        return {r.request_id: t for r, t in zip(sampling, tokens)}
