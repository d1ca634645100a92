"""Triton-language kernels (the CUDA path); each has a twin with the same signature in
pagedserve.kernels.reference. Importing this package needs `triton` (pip install pagedserve[gpu])."""

from pagedserve.kernels.triton.attention import paged_attention
from pagedserve.kernels.triton.kv_store import reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache"]
