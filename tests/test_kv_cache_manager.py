"""Block pool and KV cache manager: allocation, freeing, invariants, LRU order."""

from __future__ import annotations

import pytest

from pagedserve.core.kv_cache.block_pool import BlockPool
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.request import Sample
from pagedserve.core.sampling_params import SamplingParams


def req(rid: str, n: int) -> Sample:
    return Sample(request_id=rid, prompt_token_ids=list(range(1, n + 1)), sampling_params=SamplingParams(),
                   eos_token_id=None, max_tokens=16)


def test_pool_hands_out_each_block_once_and_takes_it_back():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(5)
    assert len({x.block_id for x in a + b}) == 8
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks(a)
    assert pool.num_free_blocks == 3
    pool.check_invariants({x.block_id: 1 for x in b})
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks(a[:1])


def test_invariant_check_catches_a_leak():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(AssertionError):
        pool.check_invariants({blocks[0].block_id: 1})  # blocks[1] is held by nobody: a leak


def test_allocate_grows_by_whole_blocks_and_frees_everything():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r = req("a", 9)
    assert len(kv.allocate_slots(r, 9)) == 3  # ceil(9 / 4)
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 1) == []  # token 10 still fits in block 3
    r.num_computed_tokens = 12
    assert len(kv.allocate_slots(r, 1)) == 1  # token 13 needs block 4
    assert kv.num_used_blocks == 4
    kv.check_invariants()
    kv.free(r)
    assert kv.num_free_blocks == 10
    kv.check_invariants()


def test_allocation_failure_has_no_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = req("a", 12), req("b", 8)
    assert kv.allocate_slots(a, 12) is not None
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1
    assert kv.get_block_ids(b) == []
    kv.check_invariants()


def test_usage_reports_fraction_of_blocks_in_use():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    kv.allocate_slots(req("a", 8), 8)
    assert kv.usage == pytest.approx(0.5)
    assert kv.can_fit(16) and not kv.can_fit(17)
