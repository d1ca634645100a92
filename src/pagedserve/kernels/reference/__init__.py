"""Pure-torch reference ops: the CPU path of the engine where no compiler exists, and the oracle
for every Triton and C++ kernel."""

from pagedserve.kernels.reference.attention import paged_attention, reshape_and_cache
from pagedserve.kernels.reference.layers import add_rms_norm, rms_norm, gelu_tanh_and_mul, rotary_qkv, silu_and_mul
from pagedserve.kernels.reference.lora import lora_add
from pagedserve.kernels.reference.sampling import argmax_rows

__all__ = ["paged_attention", "reshape_and_cache", "rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_qkv",
           "argmax_rows", "lora_add"]
