"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a packed batch.

Plain PyTorch in the manner of gpt-fast: weights are tensors, forward is a few lines per block.
q/k/v and gate/up projections are fused into one matmul each at load time (fewer, larger GEMMs),
and every projection is a `Linear` whose weight is prepared once for the device's GEMM
(core/layers/linear.py). Everything else goes through the kernel backend chosen at start-up
(kernels/cpu on CPU, kernels/triton on CUDA, kernels/reference as the oracle), which has the same
ops everywhere: the fused residual-add + RMSNorm, silu-and-mul, the qkv split with RoPE, storing
this step's K/V through slot_mapping (quantizing on write for int8/fp8 caches) and attending
through block_table (dequantizing on load).

The residual stream follows Hugging Face's arithmetic: residual = residual + sublayer output in
the model dtype, then the next norm of it; only the rows whose logits are needed get the final
add and norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.core.forward_batch import ForwardBatch
from pagedserve.core.kv_cache.cache_tensors import KVCacheTensors  # noqa: F401  (re-exported)
from pagedserve.core.layers.linear import Linear
from pagedserve.core.layers.rotary import RotaryEmbedding
from pagedserve.core.models.arch import ModelArch

# On a CPU whose backend packs no fp32 LM head (neither AVX-512 nor AVX2: kernels/cpu/linear.py), it
# runs as matmuls over slices of this many vocabulary rows: one GEMM over a 49k-row weight with few
# input rows measured 1.4x (64 rows) to 1.6x (8 rows) slower in MKL than 1024-row slices whose outputs
# stay in L2 (2-core AVX2 EPYC; 1.7x at 8 rows on an AMX Xeon).
# Same dot products, bit-identical logits. A bf16 head packed for oneDNN (core/layers/linear.py)
# is fastest whole: 3.2 vs 5.2 ms at 1 row, 6.5 vs 8.9 ms at 64 rows on the AMX Xeon, and the
# backend's own packing (kernels/cpu/linear.py, AMX) faster again.
CPU_LM_HEAD_SLICE = 1024


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaDecoder:
    def __init__(self, arch: ModelArch, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor, max_position: int,
                 kernels: ModuleType) -> None:
        """kernels: the backend module (pagedserve.kernels.cpu / .triton / .reference)."""
        self.arch = arch
        self.embed = embed
        self.layers = layers
        self.norm = norm
        whole = Linear(lm_head, prepack=getattr(kernels, "prepack_linear", None))
        if whole.packed is None and whole.kernel is None and embed.device.type == "cpu":
            self.lm_head = [Linear(w) for w in lm_head.split(CPU_LM_HEAD_SLICE)]
        else:
            self.lm_head = [whole]
        self.kernels = kernels
        self.dtype = embed.dtype
        self.device = embed.device
        rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling, embed.device)
        self.cos, self.sin = rotary.tables(self.dtype)
        self.scale = arch.head_dim**-0.5
        # A tied embedding whose LM head the backend packed in a layout it reads rows back from
        # (kernels/cpu/linear.py, AMX) is looked up there, so its plain copy is not kept beside the
        # packed one (54 MiB for SmolLM2; the same bf16 values, so the same embeddings).
        self.embed_rows = None
        if lm_head is embed and getattr(whole.kernel, "rows", None) is not None:
            self.embed_rows, self.embed = whole.kernel.rows, None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCacheTensors]) -> torch.Tensor:
        """Logits [num_sampled, vocab] (fp32) for batch.logits_indices."""
        ops, eps = self.kernels, self.arch.rms_norm_eps
        if self.embed_rows is not None:
            residual = self.embed_rows(batch.input_ids)
        else:
            residual = F.embedding(batch.input_ids, self.embed)
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        for i, (w, kv) in enumerate(zip(self.layers, kv_caches)):
            x = self._attention(x, w, kv, batch, i)
            x, residual = ops.add_rms_norm(x, residual, w.post_norm, eps)
            x = w.down(ops.silu_and_mul(w.gate_up(x)))
            if i + 1 < len(self.layers):
                x, residual = ops.add_rms_norm(x, residual, self.layers[i + 1].input_norm, eps)
        rows = batch.logits_indices
        h = ops.rms_norm(residual[rows] + x[rows], self.norm, eps)
        if len(self.lm_head) == 1:
            return self.lm_head[0](h).float()
        return torch.cat([head(h) for head in self.lm_head], dim=1).float()

    def _attention(self, x: torch.Tensor, w: LayerWeights, kv: KVCacheTensors, batch: ForwardBatch,
                   layer: int) -> torch.Tensor:
        a = self.arch
        q, k, v = self.kernels.rotary_qkv(w.qkv(x), batch.positions, self.cos, self.sin, a.num_heads,
                                          a.num_kv_heads, w.q_norm, w.k_norm, a.rms_norm_eps)
        # Quantized caches: scales are written with the codes and read back inside the attention.
        self.kernels.reshape_and_cache(k, v, kv.key_cache, kv.value_cache, batch.slot_mapping, kv.k_scale, kv.v_scale)
        o = self.kernels.paged_attention(
            q, kv.key_cache, kv.value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
            self.scale, batch.max_query_len, batch.max_seq_len, a.sliding_windows[layer], kv.k_scale, kv.v_scale,
        )
        return w.o(o.reshape(x.shape[0], a.num_heads * a.head_dim))
