"""Undo the value changes llama.cpp makes while writing a GGUF, per architecture.

- llama (and Mistral): q/k rows are permuted from HF's rotate-half RoPE layout to GGML's
  interleaved one; other architectures are written with NEOX-style RoPE and keep HF's order.
- gemma2/gemma3: HF's Gemma RMSNorm multiplies by (1 + weight); llama.cpp stores weight + 1 so a
  plain RMSNorm works, so every norm weight gets 1 subtracted back.
"""

from __future__ import annotations

import numpy as np


def reverse_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotate-half layout -> GGML interleaved rope).

    llama.cpp writes `w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`, which pairs
    the two halves of each head's rotary dims; swapping the same axes back restores the HF order.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def to_hf_values(arch: str, gguf_name: str, values: np.ndarray, config: dict) -> np.ndarray:
    """`values` of GGUF tensor `gguf_name` as the HF checkpoint holds them."""
    if arch == "llama":
        if ".attn_q." in gguf_name:
            return reverse_permute(values, config["num_attention_heads"])
        if ".attn_k." in gguf_name:
            return reverse_permute(values, config["num_key_value_heads"])
    if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
        return values - np.float32(1.0)
    return values
