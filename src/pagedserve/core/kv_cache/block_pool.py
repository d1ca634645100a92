"""BlockPool: the fixed set of KV blocks, their reference counts, and the LRU queue of free ones.

A free block keeps its prefix hash (and its K/V in the cache tensors) until it is handed out
again, so a later request with the same prefix can take it back from the free queue: that is the
whole of prefix caching's memory management. Eviction order is least recently freed first; blocks
that hold no reusable prefix go to the front of the queue, so they are always taken before any
cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    """Hash of this block's full token content chained through its prefix; None if not cached."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict gives O(1) pop from the head, append at the tail and removal from the middle
        # (a prefix-cache hit on a free block), which is all an LRU free list needs.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evicted_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue (evicting their cached prefix)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evicted_blocks += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference on blocks (prefix hit or shared prompt); revive free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in eviction order (the first freed is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block under its hash (first writer wins; duplicates stay private)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their K/V can no longer be trusted). Only with every block free."""
        if self.num_used_blocks:
            raise RuntimeError(f"cannot reset the prefix cache while {self.num_used_blocks} blocks are in use")
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    def check_invariants(self, owners: dict[int, int]) -> None:
        """Raise AssertionError unless every block is owned `ref_cnt` times or free, exactly once.

        owners: block_id -> number of live block tables holding it.
        """
        for block in self.blocks:
            held = owners.get(block.block_id, 0)
            assert block.ref_cnt == held, f"block {block.block_id}: ref_cnt {block.ref_cnt} != {held} owners"
            assert (block.ref_cnt == 0) == (block.block_id in self._free), f"block {block.block_id} free-list mismatch"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks), "stale hash index"
