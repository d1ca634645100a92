"""GGUF tensor names -> Hugging Face tensor names, one table per architecture.

llama.cpp's convert_hf_to_gguf.py renames every tensor to `token_embd`, `blk.<N>.<kind>`, ...; these
tables reverse it for the architectures pagedserve runs. A tensor a table does not list is refused:
silently dropping one would load a model that computes something else.
"""

from __future__ import annotations

from pagedserve.core.errors import UnsupportedModel

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LLAMA = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3 = {**_LLAMA, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2/3 norm around both sub-blocks: llama.cpp's `ffn_norm` is the *pre*-feed-forward norm there,
# and `post_attention_norm` (not `ffn_norm`) is HF's post_attention_layernorm.
_GEMMA2 = {
    **_LLAMA,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3 = {**_GEMMA2, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Phi-3 keeps q/k/v fused in one matrix and gate/up fused in `ffn_up`, as HF's Phi3 does.
_PHI3 = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}

LAYER_NAMES = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _QWEN3,
    "gemma2": _GEMMA2,
    "gemma3": _GEMMA3,
    "phi3": _PHI3,
}

# Tensors that carry configuration rather than weights (read by hf_config, never written as weights).
CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(arch: str, gguf_name: str) -> str:
    """The Hugging Face name of GGUF tensor `gguf_name` in a model of GGUF architecture `arch`."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if base in _GLOBAL:
            return f"{_GLOBAL[base]}.{suffix}"
        parts = base.split(".")  # blk.<N>.<kind>
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES[arch]:
            return f"model.layers.{parts[1]}.{LAYER_NAMES[arch][parts[2]]}.{suffix}"
    raise UnsupportedModel(
        f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in a {arch!r} model; "
        "this file holds something pagedserve does not convert"
    )
