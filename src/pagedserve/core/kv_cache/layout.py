"""KVCacheLayout: which layers share a block table, and which keep only their sliding window.

Layers are grouped by attention kind (full attention; each sliding window size). Every group has
its own block table per sample, from one shared BlockPool: a sliding-window group returns the
blocks that fall wholly before its window to the pool and keeps a placeholder (the null block) at
their positions, so its table still indexes by position. Full-attention layers keep everything.

One pool serves every group because all groups have the same number of layers: a pool block is
the K/V of `layers_per_block` layers for block_size tokens, and the j-th layer of every group
reads and writes the j-th cache tensor at the block ids of its own group (the idea of vLLM v1's
hybrid KV cache manager). A model with one attention kind is one group of all its layers, laid out
as before (one tensor per layer); so is every model when the hybrid layout is turned off.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]
    """Model layer indices, in order; the i-th uses cache tensor i."""
    sliding_window: int | None
    """None: full attention (keeps every block); else the window in tokens (frees the blocks before it)."""

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk_tokens: int | None) -> int:
        """Most blocks one sample of num_tokens ever holds in this group at once. A sliding group
        holds the blocks of its window before the step's first token plus those of the step's
        chunk: positions [p - window + 1, p + chunk - 1] span at most cdiv(window - 1 + chunk) + 1
        blocks (one more when they start mid-block)."""
        full = cdiv(num_tokens, block_size)
        if self.sliding_window is None or max_chunk_tokens is None:
            return full
        return min(full, cdiv(self.sliding_window - 1 + max_chunk_tokens, block_size) + 1)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    """Full-attention groups first, so group 0 is the one prefix-cache lookups by hash go to."""
    layers_per_block: int
    """Cache tensors allocated (K and V each); a block holds one token range of this many layers."""

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def frees_blocks(self) -> bool:
        """Whether some group drops blocks before its window (and so needs the null block)."""
        return any(g.sliding_window is not None for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def group_and_tensor_of_layers(self) -> list[tuple[int, int]]:
        """Per model layer: (its group, the cache tensor it uses)."""
        out: list[tuple[int, int] | None] = [None] * self.num_layers
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        assert all(o is not None for o in out), "every layer belongs to one group"
        return out  # type: ignore[return-value]

    def max_blocks_per_seq(self, num_tokens: int, block_size: int, max_chunk_tokens: int | None) -> int:
        """Blocks (over all groups) one sample of num_tokens can hold at once."""
        return sum(g.max_blocks(num_tokens, block_size, max_chunk_tokens) for g in self.groups)


def single_group_layout(num_layers: int, sliding_window: int | None = None) -> KVCacheLayout:
    return KVCacheLayout((KVCacheGroup(tuple(range(num_layers)), sliding_window),), num_layers)


def make_kv_cache_layout(sliding_windows: tuple[int | None, ...], hybrid: bool = True) -> KVCacheLayout:
    """The layout for a model's per-layer windows (None: full attention).

    hybrid=False, or a model whose layers all attend alike: one group of every layer; with
    hybrid=False it also keeps every block, whatever the windows (the layout before groups).
    Mixed kinds: groups of as many layers as the rarest kind has (Gemma 3: 5 local layers per
    global one, so each group holds the global layers' count); a kind whose count is not a
    multiple ends in a smaller group, whose blocks leave the unused tensors' slots idle.
    """
    n = len(sliding_windows)
    if n == 0:
        raise ValueError("a model has at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(sliding_windows):
        kinds.setdefault(window, []).append(layer)
    if not hybrid:
        return single_group_layout(n)
    if len(kinds) == 1:
        return single_group_layout(n, sliding_windows[0])
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full attention first
    groups = tuple(KVCacheGroup(tuple(kinds[w][i:i + size]), w) for w in order for i in range(0, len(kinds[w]), size))
    return KVCacheLayout(groups, size)
