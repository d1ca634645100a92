"""C++ CPU kernels (built on first use, see build.py) behind the reference's interface."""

from pagedserve.kernels.cpu.attention import paged_attention, reshape_and_cache
from pagedserve.kernels.cpu.build import CpuKernelsUnavailable, load_extension
from pagedserve.kernels.cpu.layers import add_rms_norm, rms_norm, gelu_tanh_and_mul, rotary_qkv, silu_and_mul
from pagedserve.kernels.cpu.int8_linear import prepack_int8_linear
from pagedserve.kernels.cpu.linear import prepack_linear
from pagedserve.kernels.cpu.lora import lora_add, lora_needs_groups
from pagedserve.kernels.cpu.sampling import argmax_rows

__all__ = ["paged_attention", "reshape_and_cache", "rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_qkv",
           "argmax_rows", "prepack_linear", "prepack_int8_linear", "lora_add", "lora_needs_groups",
           "CpuKernelsUnavailable", "load_extension"]
