"""The CPU KV pool: sized by what the scheduler can use, resident only where blocks were used, and
the usage it reports is a share of that pool."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.kv_cache.cache_tensors import lazy_zeros
from pagedserve.core.sampling_params import SamplingParams


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def make_engine(path, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", "device": "cpu", **settings}))


def test_default_cpu_pool_holds_max_num_seqs_full_sequences_at_most(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path, max_num_seqs=3, max_model_len=100, block_size=16)
    assert engine.num_kv_blocks == 3 * 7  # ceil(100 / 16) blocks per sequence
    # Sequences that would need more than the default budget get the budget.
    engine = make_engine(path, max_num_seqs=4096, max_model_len=1024)
    assert engine.num_kv_blocks == DEFAULT_CPU_KV_CACHE_MEMORY // engine.kv_cache_spec.bytes_per_block
    # An explicit budget or block count is taken as given.
    assert make_engine(path, max_num_seqs=1, kv_cache_memory=2**20).num_kv_blocks == \
        2**20 // engine.kv_cache_spec.bytes_per_block
    assert make_engine(path, max_num_seqs=1, num_kv_blocks=77).num_kv_blocks == 77


def test_usage_is_the_share_of_the_sized_pool(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), max_num_seqs=2, max_model_len=64, block_size=16)
    assert engine.num_kv_blocks == 8
    engine.add_request("r", list(range(1, 41)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # the whole 40-token prompt in one step: 3 blocks
    assert engine.metrics.snapshot().kv_cache_usage_perc == pytest.approx(3 / 8)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.metrics.snapshot().kv_cache_usage_perc == 0.0


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "int8"])  # int8 adds per-token scale tensors
def test_pool_memory_is_resident_only_once_blocks_are_used(tiny_model_dir, kv_cache_dtype):
    gib = 2**30
    before = rss_bytes()
    # Large blocks: the pool's Python bookkeeping (one object per block) stays small beside it.
    engine = make_engine(tiny_model_dir("llama"), kv_cache_memory=gib, kv_cache_dtype=kv_cache_dtype,
                         block_size=128)
    assert engine.num_kv_blocks * engine.kv_cache_spec.bytes_per_block > 0.99 * gib
    grown = rss_bytes() - before
    outs = engine.generate([list(range(1, 60))], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert len(outs[0].token_ids) == 20
    used = rss_bytes() - before
    assert grown < gib / 16 and used < gib / 16, (grown, used)  # a 1 GiB pool, well under 64 MiB resident


def test_lazy_zeros_reads_zero_and_writes_through():
    t = lazy_zeros((4, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (4, 16, 2, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 64 == 0 and not t.any()
    t[2, 3] = 1.5
    assert t.sum().item() == 1.5 * 16
