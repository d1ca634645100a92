"""KVCacheManager: block tables per request on top of the BlockPool, with prefix caching.

The scheduler talks to this class only (never to the pool): it asks for the blocks a request can
reuse, then for room for n more tokens, and gets blocks or None (out of memory: preempt).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedserve.core.kv_cache.block_pool import BlockPool, KVBlock
from pagedserve.core.kv_cache.prefix_hash import extend_block_hashes
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    hits: int = 0
    """Of those, tokens found cached."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._req_to_hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (free cached blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def _uses_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching and request.use_prefix_cache

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(
                hashes, request.token_ids_slice(0, request.num_tokens), self.block_size, request.cache_salt
            )
        return hashes

    def prefix_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks (empty when it does not use the prefix cache);
        scheduling policies compare them to group requests that share a prefix."""
        return self._block_hashes(request) if self._uses_cache(request) else []

    def num_held_blocks(self, request: Request) -> int:
        return len(self.req_to_blocks.get(request.request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks starting the request's tokens, and its length in
        tokens. The last token is never taken from the cache: it must run to produce logits."""
        if not self._uses_cache(request):
            return [], 0
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one lookup once the request is admitted: a request that waits at the head of the
        queue is looked up again every step, and counting each try would inflate both counters."""
        if self._uses_cache(request):
            self.prefix_stats.queries += request.num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def get_shared_prompt_blocks(self, leader: Request, request: Request) -> tuple[list[KVBlock], int]:
        """The leader's full blocks that hold only prompt tokens the sample shares (n > 1), with
        the same rule as a prefix hit: the sample computes at least its last prompt token."""
        usable = min(leader.num_computed_tokens, request.num_prompt_tokens - 1) // self.block_size
        blocks = self.req_to_blocks.get(leader.request_id, [])[:usable]
        return list(blocks), len(blocks) * self.block_size

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit in the pool (with nothing else running)."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for num_new_tokens after the request's computed tokens (and prefix hits).

        Returns the newly allocated blocks, or None, without side effects, if the pool is short.
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(hits)
        # A hit on a free block takes it out of the free queue, so it costs capacity too.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(hits)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(hits)
        blocks.extend(new_blocks)
        if self._uses_cache(request):
            self._cache_full_blocks(request, blocks, (num_computed + num_new_tokens) // self.block_size)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        # Blocks filled in this step are registered now: every layer stores the whole batch's K/V
        # before any attention reads, so a request scheduled later in the same step may share them.
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, min(num_full, len(hashes))):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = min(num_full, len(hashes))

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so its least shareable blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def forget(self, request: Request) -> None:
        """Drop per-request hash state once the request is finished for good."""
        self._req_to_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and all per-request state; only when no request holds blocks."""
        self.pool.reset_prefix_cache()
        self._req_to_hashes.clear()
        self._num_cached_blocks.clear()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def check_invariants(self) -> None:
        owners = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        for request_id, blocks in self.req_to_blocks.items():
            assert len({b.block_id for b in blocks}) == len(blocks), f"{request_id} holds a block twice"
        self.pool.check_invariants(dict(owners))
