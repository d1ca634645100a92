"""Pure-torch reference ops: the CPU path of the engine and the oracle for every Triton kernel."""

from pagedserve.kernels.reference.attention import paged_attention, reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache"]
