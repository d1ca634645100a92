"""The decoder of every supported family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2, Gemma 2,
Gemma 3 text, Phi-3 / Phi-3.5 / Phi-4-mini) over a packed batch; core/models/arch.py says how the
families differ.

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
add and norm. Gemma normalises each sublayer's output too (post-attention, post-feedforward)
before adding it, and its norms multiply by (1 + weight): the loader stores 1 + weight, so every
norm here is the same op (exact in fp32; bf16 rounds the product where transformers computes it in
fp32, so bf16 Gemma is close, not token-exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.core.forward_batch import ForwardBatch
from pagedserve.core.kv_cache.cache_tensors import KVCacheTensors  # noqa: F401  (re-exported)
from pagedserve.core.layers.linear import Linear
from pagedserve.core.layers.rotary import RotaryEmbedding
from pagedserve.core.models.arch import ModelArch
from pagedserve.kernels.reference.int8_linear import Int8Weight

# On a CPU whose backend packs no fp32 LM head (neither AVX-512 nor AVX2: kernels/cpu/linear.py), it
# runs as matmuls over slices of this many vocabulary rows: one GEMM over a 49k-row weight with few
# input rows measured 1.4x (64 rows) to 1.6x (8 rows) slower in MKL than 1024-row slices whose outputs
# stay in L2 (2-core AVX2 EPYC; 1.7x at 8 rows on an AMX Xeon).
# Same dot products, bit-identical logits. A bf16 head packed for oneDNN (core/layers/linear.py)
# is fastest whole: 3.2 vs 5.2 ms at 1 row, 6.5 vs 8.9 ms at 64 rows on the AMX Xeon, and the
# backend's own packing (kernels/cpu/linear.py, AMX) faster again.
CPU_LM_HEAD_SLICE = 1024

# Logits of this size range are written into a buffer kept from step to step (LlamaDecoder.
# _logits_buffer): from 8 MB, past which fresh pages show, up to 256 MB (Gemma 3's vocabulary at
# 256 rows), beyond which a buffer kept for the rare long prompt-logprobs chunk would be waste.
REUSED_LOGITS_MIN_BYTES = 8 << 20
REUSED_LOGITS_MAX_BYTES = 256 << 20


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    """Llama: the norm before the MLP. Gemma: the norm of the attention output."""
    gate_up: Linear
    down: Linear
    pre_ff_norm: torch.Tensor | None = None
    """Gemma: the norm before the MLP."""
    post_ff_norm: torch.Tensor | None = None
    """Gemma: the norm of the MLP output."""


class LlamaDecoder:
    def __init__(self, arch: ModelArch, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor | None, max_position: int,
                 kernels: ModuleType, int8_lm_head: Int8Weight | None = None) -> None:
        """kernels: the backend module (pagedserve.kernels.cpu / .triton / .reference); int8_lm_head:
        the LM head's weight quantized to int8 (`quantization: int8`), used in place of lm_head (a
        tied embedding, lm_head is embed, then reads its rows back from the same codes)."""
        self.arch = arch
        self.embed = embed
        self.layers = layers
        self.norm = norm
        whole = Linear(lm_head if int8_lm_head is None else int8_lm_head,
                       prepack=getattr(kernels, "prepack_linear", None),
                       prepack_int8=getattr(kernels, "prepack_int8_linear", None), dtype=embed.dtype)
        if whole.packed is None and whole.kernel is None and embed.device.type == "cpu":
            self.lm_head = [Linear(w) for w in lm_head.split(CPU_LM_HEAD_SLICE)]
        else:
            self.lm_head = [whole]
        self.kernels = kernels
        self.dtype = embed.dtype
        self.device = embed.device
        self.rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling, embed.device,
                                      arch.max_position_embeddings, self.dtype)
        # Gemma 3's sliding-window layers rotate with their own parameters (theta 10k, no scaling).
        self.local_rotary = self.rotary
        if arch.local_rope_scaling is not None:
            self.local_rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.local_rope_scaling,
                                                embed.device, arch.max_position_embeddings, self.dtype)
        self.scale = arch.attn_scale if arch.attn_scale is not None else arch.head_dim**-0.5
        gelu = arch.hidden_act == "gelu_pytorch_tanh"
        self.act_and_mul = kernels.gelu_tanh_and_mul if gelu else kernels.silu_and_mul
        self.activation = "gelu_tanh" if gelu else "silu"  # act_and_mul's name for Linear.act_and_mul
        # transformers multiplies by a float32 tensor cast to the weight dtype.
        self.embed_scale = (torch.tensor(arch.hidden_size**0.5, dtype=self.dtype, device=self.device)
                            if arch.gemma_norms else None)
        # A tied embedding whose LM head the backend packed in a layout it reads rows back from
        # (kernels/cpu/linear.py, AMX) is looked up there, so its plain copy is not kept beside the
        # packed one (54 MiB for SmolLM2; the same bf16 values, so the same embeddings).
        self.embed_rows = None
        if lm_head is embed and getattr(whole.kernel, "rows", None) is not None:
            self.embed_rows, self.embed = whole.kernel.rows, None
        self._logits: torch.Tensor | None = None  # _logits_buffer's
        self.between_layers: Callable[[], None] | None = None
        """Called after each layer: the engine's thread governor looks there too, because a step
        slowed by a neighbour can last seconds, and it should not wait for the step's end to react
        (core/thread_governor.py)."""

    def _logits_buffer(self, rows: int) -> torch.Tensor | None:
        """Where the LM head writes this step's float32 logits when they are large: one CPU buffer
        reused from step to step, so that the logits (valid until the next forward) come without
        fresh pages. glibc maps every block over 32 MB afresh and the OS faults in and zeroes
        each 4 KB page on first touch: Gemma 3's 262,144-word logits at 64 rows (67 MB) took 17 ms to fill
        fresh against 1.3 ms reused, on a 2-core AMX Xeon. Logits over REUSED_LOGITS_MAX_BYTES
        (prompt logprobs over a long chunk) are allocated per step, as small ones are."""
        vocab = self.lm_head[0].out_features
        size = rows * vocab * 4
        if self.device.type != "cpu" or size < REUSED_LOGITS_MIN_BYTES or size > REUSED_LOGITS_MAX_BYTES:
            return None
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, vocab)
        return self._logits[:rows]

    @property
    def needs_rope_lengths(self) -> bool:
        """Whether forward() needs ForwardBatch.rope_lengths (longrope, dynamic NTK)."""
        return self.rotary.length_dependent or self.local_rotary.length_dependent

    @property
    def rope_switch_length(self) -> int | None:
        """Longrope's switch (RotaryEmbedding.switch_length), else None."""
        return self.rotary.switch_length

    def prefix_cache_key(self, prompt_len: int) -> str | None:
        """What else two prompts must share for their cached K/V to be interchangeable (None: nothing)."""
        return self.rotary.prefix_cache_key(prompt_len)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCacheTensors]) -> torch.Tensor:
        """Logits [num_sampled, vocab] (fp32) for batch.logits_indices."""
        return self.logits(self.final_hidden(batch, kv_caches))

    @torch.inference_mode()
    def greedy_tokens(self, batch: ForwardBatch, kv_caches: list[KVCacheTensors],
                      argmax_rows: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """argmax_rows(self.forward(batch, kv_caches)), int64 [num_sampled]: the greedy tokens. Where
        the LM head's kernel folds its outputs into the argmax (Linear.argmax), the logits are
        never stored; a final softcap (Gemma 2) keeps the logits path, because tanh can round two
        different logits to one value and so change which comes first."""
        h = self.final_hidden(batch, kv_caches)
        if len(self.lm_head) == 1 and self.arch.final_softcap is None:
            return self.lm_head[0].argmax(h, argmax_rows)
        return argmax_rows(self.logits(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over final_hidden's rows: fp32 logits (bf16-rounded for bf16 models), valid
        until the next forward (_logits_buffer)."""
        if len(self.lm_head) == 1:
            logits = self.lm_head[0].float_out(h, self._logits_buffer(h.shape[0]))
        else:
            logits = torch.cat([head(h) for head in self.lm_head], dim=1).float()
        if self.arch.final_softcap is not None:
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return logits

    def final_hidden(self, batch: ForwardBatch, kv_caches: list[KVCacheTensors]) -> torch.Tensor:
        """The decoder's normed output at batch.logits_indices: what the LM head reads."""
        ops, eps, gemma = self.kernels, self.arch.rms_norm_eps, self.arch.gemma_norms
        if self.embed_rows is not None:
            residual = self.embed_rows(batch.input_ids)
        else:
            residual = F.embedding(batch.input_ids, self.embed)
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        # Each rope's (cos, sin, row per token) for this batch, shared by the layers that use it.
        ropes = {id(r): r.rows(batch.positions, batch.rope_lengths) for r in (self.rotary, self.local_rotary)}
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        # A prefill chunk's rows other than its last feed the logits through no layer after this
        # one: the last layer takes only the logits rows past its K / V (ForwardBatch.sampled).
        last = len(self.layers) - 1 if batch.sampled is not None else None
        for i, (w, kv) in enumerate(zip(self.layers, kv_caches)):
            window = self.arch.sliding_windows[i]
            rope = ropes[id(self.local_rotary if window is not None else self.rotary)]
            x = self._attention(i, x, w, kv, batch, window, rope, only_sampled=i == last)
            if i == last:
                residual = residual[batch.logits_indices]
            if gemma:
                x = ops.rms_norm(x, w.post_norm, eps)
                x, residual = ops.add_rms_norm(x, residual, w.pre_ff_norm, eps)
            else:
                x, residual = ops.add_rms_norm(x, residual, w.post_norm, eps)
            if batch.lora is None:
                x = w.down(w.gate_up.act_and_mul(x, self.activation, self.act_and_mul))
            else:  # each row adds its own adapter's update to each projection (core/lora/slots.py)
                gate_up = w.gate_up(x)
                batch.lora.add(i, "gate_up", x, gate_up)
                h = self.act_and_mul(gate_up)
                x = w.down(h)
                batch.lora.add(i, "down", h, x)
            if gemma:
                x = ops.rms_norm(x, w.post_ff_norm, eps)
            if i + 1 < len(self.layers):
                x, residual = ops.add_rms_norm(x, residual, self.layers[i + 1].input_norm, eps)
            if self.between_layers is not None:
                self.between_layers()
        if last is not None:  # the rows are the logits rows already
            return ops.rms_norm(residual + x, self.norm, eps)
        rows = batch.logits_indices
        return ops.rms_norm(residual[rows] + x[rows], self.norm, eps)

    def _attention(self, layer: int, x: torch.Tensor, w: LayerWeights, kv: KVCacheTensors, batch: ForwardBatch,
                   window: int | None, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   only_sampled: bool = False) -> torch.Tensor:
        """The attention block's output for every row, or (only_sampled) for batch.sampled's rows,
        each its request's last, attending as a decode row does; every row's K and V are cached."""
        a = self.arch
        cos, sin, rows = rope
        qkv = w.qkv(x)
        if batch.lora is not None:
            batch.lora.add(layer, "qkv", x, qkv)
        q, k, v = self.kernels.rotary_qkv(qkv, rows, cos, sin, a.num_heads, a.num_kv_heads, w.q_norm, w.k_norm,
                                          a.rms_norm_eps, a.head_dim)
        # Quantized caches: scales are written with the codes and read back inside the attention.
        # Each layer group has its own block table (sliding-window groups drop blocks before the window).
        block_table, slot_mapping = batch.cache_indexing(kv.group)
        self.kernels.reshape_and_cache(k, v, kv.key_cache, kv.value_cache, slot_mapping, kv.k_scale, kv.v_scale)
        query_start_loc, seq_lens, max_query_len, max_seq_len = (batch.query_start_loc, batch.seq_lens,
                                                                 batch.max_query_len, batch.max_seq_len)
        if only_sampled:
            sampled = batch.sampled
            q, block_table = q[batch.logits_indices], sampled.block_tables[kv.group]
            query_start_loc, seq_lens, max_query_len, max_seq_len = (sampled.query_start_loc, sampled.seq_lens, 1,
                                                                     sampled.max_seq_len)
        o = self.kernels.paged_attention(
            q, kv.key_cache, kv.value_cache, block_table, query_start_loc, seq_lens,
            self.scale, max_query_len, max_seq_len, window, kv.k_scale, kv.v_scale, a.attn_softcap,
        )
        o = o.reshape(q.shape[0], a.num_heads * a.head_dim)
        if batch.lora is None:
            return w.o(o)
        out = w.o(o)
        batch.lora.add(layer, "o", o, out)
        return out
