"""A bound on oneDNN's primitive caches, whose default keeps growing with every batch size served.

Where oneDNN runs the bf16 GEMMs (CPUs with AVX512-BF16 but no AMX; on AMX, layers off the AMX
kernel's blocking, kernels/cpu/linear.py), the packed Linear layers (core/layers/linear.py) call
oneDNN, which builds one primitive (JIT code and descriptors, ~0.57 MiB each with torch 2.13 on an
AMX Xeon, whatever the GEMM's size) per distinct GEMM shape: per weight shape and per row count.
A serving batch changes its row count whenever a request joins or leaves, and every prefill chunk
has its own. oneDNN keeps up to 1024 primitives in its primitive cache and ideep (torch's oneDNN
layer) as many again in its per-thread LRU cache, both holding the same primitives: ~570 MiB that
never goes away once enough shapes have been served. The 64-request W64 workload alone builds 295
(61 row counts x 5 weight shapes, ~165 MiB).

Nearly all reuse is within a few steps (every layer of a step runs the same 5 shapes), so a small
LRU loses almost nothing: replaying W64's GEMM shapes, 32 entries miss 308 times where an unbounded
cache misses 295 (each miss costs ~5 ms of CPU to rebuild).

Both caches read their capacity from the environment once, when the process (oneDNN) or thread
(ideep) builds its first primitive, so the bound is set before the weights are packed. An operator's
own setting of either variable wins.
"""

from __future__ import annotations

import os

ONEDNN_CACHE_CAPACITY = 32
"""Primitives each cache keeps (~18 MiB at most)."""

_CAPACITY_VARIABLES = (
    ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),  # oneDNN (either spelling)
    ("LRU_CACHE_CAPACITY",),  # ideep, inside torch
)


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Set the capacity of both caches unless the environment already does; returns what this
    process now uses. Has no effect once this process has built a oneDNN primitive."""
    used = {}
    for names in _CAPACITY_VARIABLES:
        name = next((n for n in names if n in os.environ), names[0])
        used[name] = os.environ.setdefault(name, str(capacity))
    return used
