"""Pure-torch decoder-layer ops: the reference every fused kernel is tested against.

The arithmetic is Hugging Face's for Llama-family models (token-exact greedy parity in fp32):
activations in the model dtype, the RMS statistics in fp32, every op's result in the model dtype.
kernels/cpu/layers.py fuses each into one pass; kernels/triton re-exports these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_qkv", "apply_rotary"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, as LlamaRMSNorm."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(residual + x), residual + x): a layer's residual connection and the next norm."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up = [gate | up] (the fused gate/up projection's output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up (Gemma's MLP: transformers' gelu_pytorch_tanh is torch's tanh GELU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, 1, head_dim] (neox halves)."""
    return (x * cos) + (_rotate_half(x) * sin)


def rotary_qkv(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int,
               q_norm: Tensor | None = None, k_norm: Tensor | None = None, eps: float = 0.0,
               head_dim: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Split a fused qkv projection [n, (H + 2 * KV) * D] into q [n, H, D], k and v [n, KV, D];
    q and k are RMS-normalised per head when q_norm/k_norm are given (Qwen3, Gemma 3), then rotated
    by their positions. cos/sin: [rows, R] tables in the model dtype, gathered by `positions`; R is
    the rotary dim: the first R dims of each head rotate (neox halves of R), the rest pass through
    (partial_rotary_factor, Phi-4-mini). head_dim: D, when R < D (default R)."""
    n = qkv.shape[0]
    rot = cos.shape[1]
    head_dim = head_dim or rot
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.view(n, num_heads, head_dim)
    k = k.view(n, num_kv_heads, head_dim)
    v = v.reshape(n, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    if rot == head_dim:
        return apply_rotary(q, c, s), apply_rotary(k, c, s), v
    return (torch.cat((apply_rotary(q[..., :rot], c, s), q[..., rot:]), -1),
            torch.cat((apply_rotary(k[..., :rot], c, s), k[..., rot:]), -1), v)
