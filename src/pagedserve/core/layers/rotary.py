"""Rotary position embeddings with the scaling variants Llama-family configs use.

cos/sin are precomputed once in fp32 for every position and cast to the model dtype once; the
kernels gather them per forward by position, which is the same arithmetic as Hugging Face
(positions * inv_freq in fp32, then cos/sin, then a cast to the activation dtype), so greedy
outputs stay token-exact. The rotation itself is kernels/reference/layers.apply_rotary.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.core.errors import UnsupportedModel


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _default_inv_freq(rope_theta, head_dim)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise UnsupportedModel(
        f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3); "
        "remove rope_scaling from config.json to run at the native context length"
    )


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None, device: torch.device) -> None:
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_position, head_dim] in the model dtype, as Hugging Face casts them before
        rotating; the kernels' rotary_qkv gathers rows by position."""
        return self.cos.to(dtype).contiguous(), self.sin.to(dtype).contiguous()
