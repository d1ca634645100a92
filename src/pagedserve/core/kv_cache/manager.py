"""KVCacheManager: block tables per sample on top of the BlockPool, with prefix caching.

The scheduler talks to this class only (never to the pool): it asks for the blocks a request can
reuse, then for room for n more tokens, and gets blocks or None (out of memory: preempt); it reads
the pool's counters through the properties here. Per sample the manager keeps one record (its
block tables, its block hashes, how many of its blocks are registered in the prefix cache), keyed
by Sample.seq_id and dropped by `forget` when the sample finishes.

Layer groups (core/kv_cache/layout.py): a sample has one block table per group, all of the same
length. A sliding-window group's blocks that fall wholly before its window go back to the pool as
the sample advances (`allocate_slots`), replaced by the null block: a block id past the pool that
no sample owns and nothing writes. Block lists that cross this API for several groups (prefix
hits, shared prompt blocks, `allocate_slots`' result) are the groups' lists laid end to end; with
one group they are that group's list, as before groups existed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagedserve.core.kv_cache.block_pool import BlockPool, KVBlock
from pagedserve.core.kv_cache.group_hits import hit_blocks, longest_hit
from pagedserve.core.kv_cache.layout import KVCacheLayout, cdiv, single_group_layout
from pagedserve.core.kv_cache.prefix_hash import extend_block_hashes
from pagedserve.core.request import Sample

__all__ = ["KVCacheManager", "PrefixCacheStats", "cdiv"]


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    hits: int = 0
    """Of those, tokens found cached."""


@dataclass(slots=True, eq=False)
class _SampleBlocks:
    """The manager's state for one sample."""

    tables: list[list[KVBlock]]
    """Its block table per layer group, in token order; emptied when it is preempted or finishes."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of its full blocks of tokens; kept across preemption (the tokens do not change)."""
    num_cached_blocks: int = 0
    """Leading blocks already registered in the prefix cache (the same count in every group)."""
    num_skipped: list[int] = field(default_factory=list)
    """Per group: leading table entries already past the window (null); 0 for full attention."""


def _group_key(group: int, block_hash: bytes) -> bytes:
    """The prefix-cache key of a block of `group`: groups hold the same tokens in different blocks
    (different layers' K/V), so each registers its own; group 0 keeps the plain hash."""
    return block_hash if group == 0 else block_hash + group.to_bytes(4, "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 layout: KVCacheLayout | None = None, max_chunk_tokens: int | None = None) -> None:
        """layout: the layer groups (default: one group keeping every block).
        max_chunk_tokens: the most tokens one sample computes in a step (the scheduler's token
        budget); bounds what a sliding group holds, for `can_fit`."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout or single_group_layout(1)
        self.windows = tuple(g.sliding_window for g in self.layout.groups)
        self.num_groups = len(self.windows)
        self.max_chunk_tokens = max_chunk_tokens
        self._pool = BlockPool(num_blocks)
        self.null_block: KVBlock | None = KVBlock(num_blocks, ref_cnt=1) if self.layout.frees_blocks else None
        """Stands in for freed blocks before a window; its id is the cache tensors' extra row."""
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
        """Group 0's block with this hash in the prefix cache (held or free), or None."""
        return self._pool.get_cached_block(block_hash)

    @staticmethod
    def num_revived(hits: list[KVBlock]) -> int:
        """How many of these prefix hits are free cached blocks: taking them uses up free blocks
        as a fresh allocation would; hits held by running samples cost nothing."""
        return sum(1 for block in hits if block.ref_cnt == 0)

    # -- per sample --------------------------------------------------------------------------------
    def _uses_cache(self, request: Sample) -> bool:
        return self.enable_prefix_caching and request.use_prefix_cache

    def _state(self, request: Sample) -> _SampleBlocks:
        state = self._samples.get(request.seq_id)
        if state is None:
            g = self.num_groups
            state = self._samples[request.seq_id] = _SampleBlocks([[] for _ in range(g)], num_skipped=[0] * g)
        return state

    def _block_hashes(self, request: Sample) -> list[bytes]:
        hashes = self._state(request).block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(
                hashes, request.token_ids_slice(0, request.num_tokens), self.block_size, request.cache_salt
            )
        return hashes

    def prefix_hashes(self, request: Sample) -> list[bytes]:
        """Hashes of the request's full blocks (empty when it does not use the prefix cache);
        scheduling policies compare them to group requests that share a prefix."""
        return self._block_hashes(request) if self._uses_cache(request) else []

    def num_held_blocks(self, request: Sample) -> int:
        """Pool blocks the sample holds, over all groups (null placeholders excluded)."""
        return sum(self.num_held_blocks_per_group(request))

    def num_held_blocks_per_group(self, request: Sample) -> list[int]:
        state = self._samples.get(request.seq_id)
        if state is None:
            return [0] * self.num_groups
        return [sum(1 for b in table if b is not self.null_block) for table in state.tables]

    def get_blocks(self, request: Sample) -> list[KVBlock]:
        """The sample's block table of group 0 (a copy)."""
        state = self._samples.get(request.seq_id)
        return list(state.tables[0]) if state is not None else []

    def get_block_ids(self, request: Sample) -> list[int]:
        """Group 0's block ids."""
        state = self._samples.get(request.seq_id)
        return [b.block_id for b in state.tables[0]] if state is not None else []

    def get_group_block_ids(self, request: Sample) -> list[list[int]]:
        """Every group's block ids (null placeholders as the null block's id)."""
        state = self._samples.get(request.seq_id)
        if state is None:
            return [[] for _ in range(self.num_groups)]
        return [[b.block_id for b in table] for table in state.tables]

    def num_hit_blocks(self, hits: list[KVBlock]) -> int:
        """Pool blocks in a list of reusable blocks (the null placeholders cost nothing)."""
        return sum(1 for b in hits if b is not self.null_block)

    def get_computed_blocks(self, request: Sample) -> tuple[list[KVBlock], int]:
        """The longest prefix of the request's full blocks that every group has cached, and its
        length in tokens. The last token is never taken from the cache: it must run to produce logits."""
        if not self._uses_cache(request):
            return [], 0
        hashes = self._block_hashes(request)
        limit = min((request.num_tokens - 1) // self.block_size, len(hashes))
        pool = self._pool

        def lookup(group: int, i: int) -> KVBlock | None:
            return pool.get_cached_block(_group_key(group, hashes[i]))

        h = longest_hit(self.windows, self.block_size, limit, lookup)
        return hit_blocks(self.windows, self.block_size, h, lookup, self.null_block), h * self.block_size

    def record_prefix_lookup(self, request: Sample, num_hit_tokens: int) -> None:
        """Count one lookup once the request is admitted: a request that waits at the head of the
        queue is looked up again every step, and counting each try would inflate both counters."""
        if self._uses_cache(request):
            self.prefix_stats.queries += request.num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def get_shared_prompt_blocks(self, leader: Sample, request: Sample) -> tuple[list[KVBlock], int]:
        """The leader's full blocks that hold only prompt tokens the sample shares (n > 1), with
        the same rule as a prefix hit: the sample computes at least its last prompt token. A
        sliding group must still hold the window before the shared prefix's end, else the prefix
        is cut back to what every group holds (often nothing once the leader has moved on)."""
        state = self._samples.get(leader.seq_id)
        if state is None:
            return [], 0
        usable = min(leader.num_computed_tokens, request.num_prompt_tokens - 1) // self.block_size
        tables, null = state.tables, self.null_block

        def lookup(group: int, i: int) -> KVBlock | None:
            table = tables[group]
            return table[i] if i < len(table) and table[i] is not null else None

        h = longest_hit(self.windows, self.block_size, usable, lookup)
        return hit_blocks(self.windows, self.block_size, h, lookup, null), h * self.block_size

    def max_blocks_per_seq(self, num_tokens: int, decoding: bool = False) -> int:
        """Most pool blocks a sample of num_tokens holds at once, over all groups; decoding: once its
        prompt is computed (one token a step, so a sliding group holds its window's blocks only)."""
        return self.layout.max_blocks_per_seq(num_tokens, self.block_size, 1 if decoding else self.max_chunk_tokens)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit in the pool (with nothing else running)."""
        return self.max_blocks_per_seq(num_tokens) <= self._pool.num_blocks

    def max_fitting_tokens(self, limit: int) -> int:
        """The longest sequence of at most limit tokens that `can_fit` accepts (for error messages)."""
        lo, hi = 0, limit
        while lo < hi:  # can_fit is monotone in the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.can_fit(mid) else (lo, mid - 1)
        return lo

    def allocate_slots(
        self, request: Sample, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for num_new_tokens after the request's computed tokens (and prefix hits).

        Sliding groups first return the blocks their window has left behind. Returns the newly
        allocated blocks (the groups' laid end to end), or None, without allocating, if the pool is short.
        """
        hits = new_computed_blocks or []
        num_hit = len(hits) // self.num_groups
        state = self._samples.get(request.seq_id)
        num_held = len(state.tables[0]) if state is not None else 0
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        if state is not None and self.null_block is not None:
            self._free_outside_window(state, num_computed)
        num_needed = max(cdiv(num_computed + num_new_tokens, self.block_size) - num_held - num_hit, 0)
        # A hit on a free block takes it out of the free queue, so it costs capacity too.
        num_revived = self.num_revived(hits) if hits else 0
        if num_needed * self.num_groups > self._pool.num_free_blocks - num_revived:
            return None
        if state is None:
            state = self._state(request)
        if hits:
            self._pool.touch(b for b in hits if b is not self.null_block)
            for g, table in enumerate(state.tables):
                table.extend(hits[g * num_hit:(g + 1) * num_hit])
        new_blocks: list[KVBlock] = []
        if num_needed:  # most decode steps need none: keep them cheap
            for table in state.tables:
                blocks = self._pool.get_new_blocks(num_needed)
                table.extend(blocks)
                new_blocks.extend(blocks)
        if self._uses_cache(request):
            self._cache_full_blocks(request, state, (num_computed + num_new_tokens) // self.block_size)
        return new_blocks

    def _free_outside_window(self, state: _SampleBlocks, num_computed: int) -> None:
        """Return each sliding group's blocks that the next token's window no longer reaches."""
        null = self.null_block
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = state.tables[g]
            # The next token (position num_computed) reads positions from num_computed - window + 1.
            stop = min(max(0, num_computed - window + 1) // self.block_size, len(table))
            start = state.num_skipped[g]
            if stop <= start:
                continue
            freed = [b for b in table[start:stop] if b is not null]
            table[start:stop] = [null] * (stop - start)
            state.num_skipped[g] = stop
            self._pool.free_blocks(freed)

    def _cache_full_blocks(self, request: Sample, state: _SampleBlocks, num_full: int) -> None:
        # Blocks filled in this step are registered now: every layer stores the whole batch's K/V
        # before any attention reads, so a request scheduled later in the same step may share them.
        start = state.num_cached_blocks
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        end = min(num_full, len(hashes))
        null = self.null_block
        for g, table in enumerate(state.tables):
            for i in range(start, end):
                if table[i] is not null:  # the null block stands in for a block this group no longer needs
                    self._pool.cache_block(table[i], _group_key(g, hashes[i]))
        state.num_cached_blocks = end

    def free(self, request: Sample) -> None:
        """Return the sample's blocks, tail first, so its least shareable blocks are evicted first.
        Its block hashes stay (a preempted sample recomputes the same tokens)."""
        state = self._samples.get(request.seq_id)
        if state is None:
            return
        tables, null = state.tables, self.null_block
        state.tables = [[] for _ in tables]
        state.num_skipped = [0] * len(tables)
        state.num_cached_blocks = 0
        for table in tables:
            self._pool.free_blocks(b for b in reversed(table) if b is not null)

    def forget(self, request: Sample) -> None:
        """Drop the sample's record once it has finished for good (after `free`)."""
        self._samples.pop(request.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and all per-sample state; only when no sample holds blocks
        (the pool raises otherwise)."""
        self._pool.reset_prefix_cache()
        self._samples.clear()

    def check_invariants(self) -> None:
        null = self.null_block
        owners: Counter[int] = Counter()
        for seq_id, state in self._samples.items():
            held = [b.block_id for table in state.tables for b in table if b is not null]
            assert len(set(held)) == len(held), f"sample {seq_id} holds a block twice"
            assert len({len(t) for t in state.tables}) <= 1, f"sample {seq_id}: group tables differ in length"
            owners.update(held)
        self._pool.check_invariants(dict(owners))
