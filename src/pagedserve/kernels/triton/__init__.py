"""Triton-language kernels (the CUDA path); each has a twin with the same signature in
pagedserve.kernels.reference. Importing this package needs `triton` (pip install pagedserve[gpu]).
The decoder-layer ops and argmax_rows are the reference's torch code, which runs on the GPU as it is."""

from pagedserve.kernels.reference.layers import add_rms_norm, rms_norm, gelu_tanh_and_mul, rotary_qkv, silu_and_mul
from pagedserve.kernels.reference.sampling import argmax_rows
from pagedserve.kernels.triton.attention import paged_attention
from pagedserve.kernels.triton.kv_store import reshape_and_cache
from pagedserve.kernels.triton.lora import lora_add, lora_needs_groups

__all__ = ["paged_attention", "reshape_and_cache", "rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_qkv",
           "argmax_rows", "lora_add", "lora_needs_groups"]
