"""The longest reusable prefix when layer groups keep different blocks (core/kv_cache/layout.py).

A prefix of h blocks is reusable when every group has what computing token h * block_size onward
reads: a full-attention group all blocks [0, h); a sliding group only the blocks holding positions
[h * block_size - window + 1, h * block_size - 1] (the null block stands in for the ones before).
A sliding group may lack old blocks (freed, then evicted) yet have the last window, so its answer
is searched from the right; the groups' answers are then cut to a length every group accepts
(each check is monotone in h, so repeating the minimum converges). With one full-attention group
this is the plain longest run of leading blocks, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Block = TypeVar("Block")
Lookup = Callable[[int, int], "Block | None"]
"""(group, block index) -> the block holding that content for that group, or None."""


def first_needed_block(num_blocks: int, block_size: int, window: int | None) -> int:
    """Index of the first block that computing the token after num_blocks full blocks reads."""
    if window is None:
        return 0
    return max(0, num_blocks * block_size - window + 1) // block_size


def _group_hit(group: int, window: int | None, block_size: int, limit: int, lookup: Lookup) -> int:
    """Longest h <= limit such that this group has blocks [first_needed_block(h), h)."""
    if window is None:
        h = 0
        while h < limit and lookup(group, h) is not None:
            h += 1
        return h
    end = limit
    while end > 0:
        first = first_needed_block(end, block_size, window)
        i = end - 1
        while i >= first and lookup(group, i) is not None:
            i -= 1
        if i < first:
            return end
        end = i  # block i is missing: a usable prefix ends at or before it
    return 0


def longest_hit(windows: Sequence[int | None], block_size: int, limit: int, lookup: Lookup) -> int:
    """Blocks of the longest prefix every group can reuse (at most limit)."""
    h = limit
    while True:
        cut = h
        for group, window in enumerate(windows):
            cut = _group_hit(group, window, block_size, cut, lookup)
        if cut == h:
            return h
        h = cut


def hit_blocks(windows: Sequence[int | None], block_size: int, h: int, lookup: Lookup, null: Block) -> list[Block]:
    """The h-block prefix of every group, group after group (null before a sliding group's window)."""
    out: list = []
    for group, window in enumerate(windows):
        first = first_needed_block(h, block_size, window)
        out.extend([null] * first)
        out.extend(lookup(group, i) for i in range(first, h))
    return out
