"""C++ CPU kernels (built on first use, see build.py) behind the reference's interface."""

from pagedserve.kernels.cpu.attention import paged_attention, reshape_and_cache
from pagedserve.kernels.cpu.build import CpuKernelsUnavailable, load_extension

__all__ = ["paged_attention", "reshape_and_cache", "CpuKernelsUnavailable", "load_extension"]
