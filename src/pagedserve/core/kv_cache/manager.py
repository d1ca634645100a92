"""KVCacheManager: block tables per sample on top of the BlockPool, with prefix caching.

The scheduler talks to this class only (never to the pool): it asks for the blocks a request can
reuse, then for room for n more tokens, and gets blocks or None (out of memory: preempt); it reads
the pool's counters through the properties here. Per sample the manager keeps one record (its
blocks, its block hashes, how many of its blocks are registered in the prefix cache), keyed by
Request.seq_id and dropped by `forget` when the sample finishes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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


@dataclass(slots=True, eq=False)
class _SampleBlocks:
    """The manager's state for one sample."""

    blocks: list[KVBlock] = field(default_factory=list)
    """Its block table, in token order; emptied when it is preempted or finishes."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of its full blocks of tokens; kept across preemption (the tokens do not change)."""
    num_cached_blocks: int = 0
    """Leading blocks already registered in the prefix cache."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks)
        self._samples: dict[int, _SampleBlocks] = {}
        """seq_id -> the sample's blocks and hashes, from its first lookup until `forget`."""
        self.prefix_stats = PrefixCacheStats()

    # -- the pool's counters (what the scheduler and its policies read) ------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request holds (cached ones included: they are evicted on demand)."""
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used_blocks

    @property
    def num_evicted_blocks(self) -> int:
        """Cached blocks handed out for other content so far (their prefix is lost)."""
        return self._pool.num_evicted_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (free cached blocks count as free)."""
        return self._pool.num_used_blocks / self._pool.num_blocks

    def cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block with this hash in the prefix cache (held or free), or None."""
        return self._pool.get_cached_block(block_hash)

    @staticmethod
    def num_revived(hits: list[KVBlock]) -> int:
        """How many of these prefix hits are free cached blocks: taking them uses up free blocks
        as a fresh allocation would; hits held by running samples cost nothing."""
        return sum(1 for block in hits if block.ref_cnt == 0)

    # -- per sample --------------------------------------------------------------------------------
    def _uses_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching and request.use_prefix_cache

    def _state(self, request: Request) -> _SampleBlocks:
        state = self._samples.get(request.seq_id)
        if state is None:
            state = self._samples[request.seq_id] = _SampleBlocks()
        return state

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes = self._state(request).block_hashes
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
        state = self._samples.get(request.seq_id)
        return len(state.blocks) if state is not None else 0

    def get_blocks(self, request: Request) -> list[KVBlock]:
        """The sample's block table (a copy)."""
        state = self._samples.get(request.seq_id)
        return list(state.blocks) if state is not None else []

    def get_block_ids(self, request: Request) -> list[int]:
        state = self._samples.get(request.seq_id)
        return [b.block_id for b in state.blocks] if state is not None else []

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks starting the request's tokens, and its length in
        tokens. The last token is never taken from the cache: it must run to produce logits."""
        if not self._uses_cache(request):
            return [], 0
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.cached_block(block_hash)
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
        blocks = self.get_blocks(leader)[:usable]
        return blocks, len(blocks) * self.block_size

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit in the pool (with nothing else running)."""
        return cdiv(num_tokens, self.block_size) <= self._pool.num_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for num_new_tokens after the request's computed tokens (and prefix hits).

        Returns the newly allocated blocks, or None, without side effects, if the pool is short.
        """
        hits = new_computed_blocks or []
        state = self._samples.get(request.seq_id)
        num_held = len(state.blocks) if state is not None else 0
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - num_held - len(hits)
        # A hit on a free block takes it out of the free queue, so it costs capacity too.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > self._pool.num_free_blocks - num_revived:
            return None
        self._pool.touch(hits)
        new_blocks = self._pool.get_new_blocks(max(num_needed, 0))
        if state is None:
            state = self._state(request)
        state.blocks.extend(hits)
        state.blocks.extend(new_blocks)
        if self._uses_cache(request):
            self._cache_full_blocks(request, state, (num_computed + num_new_tokens) // self.block_size)
        return new_blocks

    def _cache_full_blocks(self, request: Request, state: _SampleBlocks, num_full: int) -> None:
        # Blocks filled in this step are registered now: every layer stores the whole batch's K/V
        # before any attention reads, so a request scheduled later in the same step may share them.
        start = state.num_cached_blocks
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, min(num_full, len(hashes))):
            self._pool.cache_block(state.blocks[i], hashes[i])
        state.num_cached_blocks = min(num_full, len(hashes))

    def free(self, request: Request) -> None:
        """Return the sample's blocks, tail first, so its least shareable blocks are evicted first.
        Its block hashes stay (a preempted sample recomputes the same tokens)."""
        state = self._samples.get(request.seq_id)
        if state is None:
            return
        blocks, state.blocks, state.num_cached_blocks = state.blocks, [], 0
        self._pool.free_blocks(reversed(blocks))

    def forget(self, request: Request) -> None:
        """Drop the sample's record once it has finished for good (after `free`)."""
        self._samples.pop(request.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and all per-sample state; only when no sample holds blocks
        (the pool raises otherwise)."""
        self._pool.reset_prefix_cache()
        self._samples.clear()

    def check_invariants(self) -> None:
        owners = Counter(b.block_id for state in self._samples.values() for b in state.blocks)
        for seq_id, state in self._samples.items():
            assert len({b.block_id for b in state.blocks}) == len(state.blocks), f"sample {seq_id} holds a block twice"
        self._pool.check_invariants(dict(owners))
