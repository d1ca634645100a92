"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a packed batch.

Plain PyTorch in the manner of gpt-fast: weights are tensors, forward is a few lines per block.
q/k/v and gate/up projections are fused into one matmul each at load time (fewer, larger GEMMs).
Attention goes through the kernel pair chosen at start-up (kernels/cpu on CPU, Triton on CUDA):
store this step's K/V through slot_mapping (quantizing on write for int8/fp8 caches), then attend
through block_table (dequantizing on load).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.core.forward_batch import ForwardBatch
from pagedserve.core.kv_cache.cache_tensors import KVCacheTensors  # noqa: F401  (re-exported)
from pagedserve.core.layers.norm import rms_norm
from pagedserve.core.layers.rotary import RotaryEmbedding, apply_rotary
from pagedserve.core.models.arch import ModelArch

# On CPU the LM head runs as matmuls over slices of this many vocabulary rows: one GEMM over a
# 49k-row weight with few input rows measured 1.4x (64 rows) to 1.6x (8 rows) slower in oneDNN /
# MKL than 1024-row slices whose outputs stay in L2. Same dot products, bit-identical logits.
CPU_LM_HEAD_SLICE = 1024


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class LlamaDecoder:
    def __init__(self, arch: ModelArch, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor, max_position: int,
                 attention: ModuleType) -> None:
        self.arch = arch
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self._lm_head_slices = lm_head.split(CPU_LM_HEAD_SLICE) if embed.device.type == "cpu" else (lm_head,)
        self.attention = attention
        self.dtype = embed.dtype
        self.device = embed.device
        self.rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling, embed.device)
        self.scale = arch.head_dim**-0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCacheTensors]) -> torch.Tensor:
        """Logits [num_sampled, vocab] (fp32) for batch.logits_indices."""
        h = F.embedding(batch.input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(batch.positions, self.dtype)
        for i, (w, kv) in enumerate(zip(self.layers, kv_caches)):
            h = h + self._attention(rms_norm(h, w.input_norm, self.arch.rms_norm_eps), w, kv, batch, cos, sin, i)
            h = h + self._mlp(rms_norm(h, w.post_norm, self.arch.rms_norm_eps), w)
        h = rms_norm(h[batch.logits_indices], self.norm, self.arch.rms_norm_eps)
        if len(self._lm_head_slices) == 1:
            return F.linear(h, self.lm_head).float()
        return torch.cat([F.linear(h, w) for w in self._lm_head_slices], dim=1).float()

    def _attention(self, x: torch.Tensor, w: LayerWeights, kv: KVCacheTensors, batch: ForwardBatch,
                   cos: torch.Tensor, sin: torch.Tensor, layer: int) -> torch.Tensor:
        a = self.arch
        n = x.shape[0]
        qkv = F.linear(x, w.qkv, w.qkv_bias)
        q, k, v = qkv.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim], -1)
        q = q.view(n, a.num_heads, a.head_dim)
        k = k.view(n, a.num_kv_heads, a.head_dim)
        v = v.view(n, a.num_kv_heads, a.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, a.rms_norm_eps)
            k = rms_norm(k, w.k_norm, a.rms_norm_eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        # Quantized caches: scales are written with the codes and read back inside the attention.
        self.attention.reshape_and_cache(k, v, kv.key_cache, kv.value_cache, batch.slot_mapping,
                                         kv.k_scale, kv.v_scale)
        o = self.attention.paged_attention(
            q, kv.key_cache, kv.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
            self.scale, batch.max_query_len, batch.max_seq_len, a.sliding_windows[layer], kv.k_scale, kv.v_scale,
        )
        return F.linear(o.reshape(n, a.num_heads * a.head_dim), w.o, w.o_bias)

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.down, w.down_bias)
