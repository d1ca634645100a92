"""Scheduling policies: which waiting request is admitted next, and whether it may start now.

The scheduler asks its policy two things per iteration and nothing else differs between policies:

  order(waiting, running, kv)               the waiting queue's new order (None: keep it), once
                                            before admission
  admit(request, hits, num_new, running, kv)  ADMIT, DEFER (skip this step, keep its place) or STOP

A policy sees the queues and the KV cache manager, never the scheduler: it orders, the scheduler
acts (so the two modules do not import each other).

`fcfs` never reorders and always admits, so the scheduler behaves exactly as it did before
policies existed (online serving's default). `prefix` orders waiting requests so those sharing the
longest cached or pending prefix run together, and defers a request whose shared prefix another
running request is still prefilling (so the prefix is computed once, then hit). `throughput` adds
BatchLLM's two ideas for offline jobs: larger decode-to-prefill ratio first (long decodes start
early instead of trailing alone at the end), and admission by projected KV memory: a request starts
only if every admitted request still fits when it reaches max_tokens, so preemption (recompute)
stays rare.

Fairness: under `prefix` and `throughput`, a request that has waited longer than
`scheduling_age_bound_s` goes to the front (oldest first), is never deferred, and ignores the KV
projection (only real free blocks gate it). Reordering can delay a request, never starve it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

from pagedserve.core.config import SCHEDULING_POLICIES
from pagedserve.core.kv_cache.block_pool import KVBlock
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.request import Sample, SampleStatus

__all__ = ["SCHEDULING_POLICIES", "Admission", "make_policy"]


class Admission(enum.Enum):
    ADMIT = enum.auto()
    DEFER = enum.auto()
    """Not this step; later requests may go ahead (it keeps its place in the queue)."""
    STOP = enum.auto()
    """Admit nothing more this step (head-of-line: nobody overtakes this request)."""


class FcfsPolicy:
    """Arrival order, admit while blocks and budget allow: the behaviour before policies."""

    name = "fcfs"

    def order(self, waiting: Sequence[Sample], running: Sequence[Sample],
              kv: KVCacheManager) -> list[Sample] | None:
        return None

    def admit(self, request: Sample, hits: list[KVBlock], num_new: dict[int, int], running: Sequence[Sample],
              kv: KVCacheManager) -> Admission:
        return Admission.ADMIT


class PrefixPolicy:
    """Group waiting requests by shared prefix, longest cached-or-pending prefix first."""

    name = "prefix"

    def __init__(self, age_bound_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.age_bound_s = age_bound_s
        self.clock = clock

    def is_aged(self, request: Sample, now: float) -> bool:
        return now - request.arrival_time > self.age_bound_s

    def order(self, waiting: Sequence[Sample], running: Sequence[Sample],
              kv: KVCacheManager) -> list[Sample] | None:
        if len(waiting) < 2:
            return None
        now = self.clock()
        pending = {h for r in running for h in kv.prefix_hashes(r)}
        group_rank: dict[bytes | None, int] = {}
        keyed = []
        for request in waiting:
            seq = request.seq_id  # arrival order: a stable tie-break that survives reordering
            if request.status == SampleStatus.PREEMPTED:
                key = (0, seq)  # it already produced tokens: resume it first, as fcfs does
            elif self.is_aged(request, now):
                key = (1, request.arrival_time, seq)
            else:
                hashes = kv.prefix_hashes(request)
                shared = 0
                for h in hashes:
                    if h not in pending and kv.cached_block(h) is None:
                        break
                    shared += 1
                group = hashes[0] if hashes else None
                rank = group_rank.setdefault(group, len(group_rank))
                key = (2, -shared, *self._within(rank, request, shared * kv.block_size), seq)
            keyed.append((key, request))
        keyed.sort(key=lambda kr: kr[0])
        return [r for _, r in keyed]

    def _within(self, group_rank: int, request: Sample, num_shared_tokens: int) -> tuple:
        """Order among requests sharing equally long prefixes: by prefix group."""
        return (group_rank,)

    def admit(self, request: Sample, hits: list[KVBlock], num_new: dict[int, int], running: Sequence[Sample],
              kv: KVCacheManager) -> Admission:
        if self.is_aged(request, self.clock()):
            return Admission.ADMIT
        if self._prefix_is_pending(request, len(hits), num_new, running, kv):
            return Admission.DEFER
        return Admission.ADMIT

    @staticmethod
    def _prefix_is_pending(request: Sample, num_hit_blocks: int, num_new: dict[int, int],
                           running: Sequence[Sample], kv: KVCacheManager) -> bool:
        """Whether a running request is still prefilling blocks this request would otherwise
        compute itself: waiting one step turns them into prefix hits."""
        if request.num_computed_tokens or request.prompt_leader is not None:
            return False
        hashes = kv.prefix_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // kv.block_size
        if num_hit_blocks >= min(len(hashes), max_hit_blocks):
            return False
        next_hash = hashes[num_hit_blocks]
        for other in running:
            done_after_step = (other.num_computed_tokens + num_new.get(other.seq_id, 0)) // kv.block_size
            other_hashes = kv.prefix_hashes(other)
            if (len(other_hashes) > num_hit_blocks >= done_after_step
                    and other_hashes[num_hit_blocks] == next_hash):
                return True
        return False


class ThroughputPolicy(PrefixPolicy):
    """Prefix grouping, then larger decode-to-prefill ratio first, admitted by projected KV."""

    name = "throughput"

    def __init__(self, age_bound_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(age_bound_s, clock)
        self._projected_blocks = 0

    def _within(self, group_rank: int, request: Sample, num_shared_tokens: int) -> tuple:
        """Larger decode-to-prefill ratio first, then by prefix group."""
        to_prefill = max(request.num_prompt_tokens - num_shared_tokens, 1)
        return (-request.max_tokens / to_prefill, group_rank)

    def order(self, waiting: Sequence[Sample], running: Sequence[Sample],
              kv: KVCacheManager) -> list[Sample] | None:
        # Blocks held now plus what running requests still add before reaching max_tokens.
        # A sliding-window group holds a prefill chunk beyond its window only while prefilling.
        growth = sum(max(kv.max_blocks_per_seq(r.num_prompt_tokens + r.max_tokens,
                                               decoding=r.num_computed_tokens >= r.num_prompt_tokens)
                         - kv.num_held_blocks(r), 0)
                     for r in running)
        self._projected_blocks = kv.num_used_blocks + growth
        return super().order(waiting, running, kv)

    def admit(self, request: Sample, hits: list[KVBlock], num_new: dict[int, int], running: Sequence[Sample],
              kv: KVCacheManager) -> Admission:
        decision = super().admit(request, hits, num_new, running, kv)
        if decision is not Admission.ADMIT:
            return decision
        revived = kv.num_revived(hits)
        final_blocks = kv.max_blocks_per_seq(request.num_prompt_tokens + request.max_tokens)
        cost = max(final_blocks - kv.num_held_blocks(request) - kv.num_hit_blocks(hits), 0) + revived
        if self._projected_blocks + cost > kv.num_blocks and not self.is_aged(request, self.clock()):
            return Admission.STOP
        self._projected_blocks += cost
        return Admission.ADMIT


def make_policy(name: str, age_bound_s: float, clock: Callable[[], float] = time.monotonic):
    if name == "fcfs":
        return FcfsPolicy()
    if name == "prefix":
        return PrefixPolicy(age_bound_s, clock)
    if name == "throughput":
        return ThroughputPolicy(age_bound_s, clock)
    raise ValueError(f"scheduling_policy={name!r}; use one of {SCHEDULING_POLICIES}")
