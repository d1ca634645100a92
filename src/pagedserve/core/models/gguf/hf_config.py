"""GGUF metadata -> the Hugging Face config.json of the same model, per architecture.

Each builder writes what transformers' own config class for that architecture reads, in the
spelling Hugging Face checkpoints use, so the converted folder loads like a downloaded one.
Values llama.cpp does not store but hard-codes per architecture (Gemma's local RoPE base, its
sliding-window layer pattern) are restored from the same constants llama.cpp uses.
"""

from __future__ import annotations

from typing import Any

from pagedserve.core.errors import UnsupportedModel
from pagedserve.core.models.gguf.metadata import f32, field
from pagedserve.core.models.gguf.rope import rope_scaling


def build_config(reader, arch: str, tensors: dict[str, Any]) -> dict:
    """config.json for a file of GGUF architecture `arch`; `tensors` maps GGUF name -> ReaderTensor."""
    config = _common(reader, arch, tensors)
    config.update(_BUILDERS[arch](reader, arch, config, tensors))
    return config


def _key(reader, arch: str, name: str, default=None):
    return field(reader, f"{arch}.{name}", default)


def _required(reader, arch: str, name: str):
    value = _key(reader, arch, name)
    if value is None:
        raise UnsupportedModel(f"GGUF metadata lacks {arch}.{name}, which a {arch} model needs")
    return value


def _common(reader, arch: str, tensors: dict) -> dict:
    hidden = int(_required(reader, arch, "embedding_length"))
    heads = int(_required(reader, arch, "attention.head_count"))
    vocab = _key(reader, arch, "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    # Chat models end a turn with an end-of-turn token (Gemma's <end_of_turn>) that differs from
    # <eos>; both stop generation, as in the HF checkpoint's generation_config.json.
    eot = field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = eos if eot is None or eot == eos or eos is None else [eos, eot]
    return {
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, arch, "feed_forward_length")),
        "num_hidden_layers": int(_required(reader, arch, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_key(reader, arch, "attention.head_count_kv", heads)),
        "head_dim": int(_key(reader, arch, "attention.key_length", hidden // heads)),
        "rms_norm_eps": f32(_required(reader, arch, "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_required(reader, arch, "context_length")),
        "vocab_size": int(vocab),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids,
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
        # float32 on purpose: dequantized values (fp16 scale * quant + fp16 min) are not exact in bf16.
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def _rope_fields(reader, arch: str, config: dict, tensors: dict) -> dict:
    theta = f32(_key(reader, arch, "rope.freq_base", 10000.0))
    scaling = rope_scaling(reader, arch, config, tensors)
    # Both spellings: transformers 4.x reads rope_theta + rope_scaling, 5.x rope_parameters.
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
    }


def _llama(reader, arch: str, config: dict, tensors: dict) -> dict:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    # llama.cpp has no "mistral" architecture for Mistral 7B / Nemo: they are written as llama, and
    # only the model name tells them apart (transformers' GGUF loader does the same).
    mistral = "mistral" in str(field(reader, "general.name", "")).lower()
    return {
        "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "mistral" if mistral else "llama",
        "head_dim": int(_key(reader, arch, "rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        **({"sliding_window": None} if mistral else {}),
        **_rope_fields(reader, arch, config, tensors),
    }


def _qwen2(reader, arch: str, config: dict, tensors: dict) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config["num_hidden_layers"],
        **_rope_fields(reader, arch, config, tensors),
    }


def _qwen3(reader, arch: str, config: dict, tensors: dict) -> dict:
    return {
        **_qwen2(reader, arch, config, tensors),
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }


def _gemma(reader, arch: str, config: dict, pattern: int) -> dict:
    layers = config["num_hidden_layers"]
    # llama.cpp: the 27B models scale queries by 1/sqrt(hidden/heads), the others by 1/sqrt(head_dim)
    # (llama-model.cpp, f_attention_scale); 46 (Gemma 2) and 62 (Gemma 3) layers are the 27B sizes.
    is_27b = layers == (46 if arch == "gemma2" else 62)
    scalar = config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": _key(reader, arch, "attention.sliding_window"),
        # llama.cpp's swa pattern: layer i slides unless i % pattern == pattern - 1 (same as HF's).
        "layer_types": [
            "full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(layers)
        ],
        "attn_logit_softcapping": _key(reader, arch, "attn_logit_softcapping"),
        "final_logit_softcapping": _key(reader, arch, "final_logit_softcapping"),
        "attention_bias": False,
        "attention_dropout": 0.0,
    }


def _gemma2(reader, arch: str, config: dict, tensors: dict) -> dict:
    fields = _gemma(reader, arch, config, pattern=2)
    theta = f32(_key(reader, arch, "rope.freq_base", 10000.0))
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        **fields,
        "rope_theta": theta,
        "rope_scaling": rope_scaling(reader, arch, config, tensors),
    }


def _gemma3(reader, arch: str, config: dict, tensors: dict) -> dict:
    fields = _gemma(reader, arch, config, pattern=6)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **fields,
        # Global layers use the file's base (and any scaling); llama.cpp hard-codes 10000 for the
        # sliding ones (rope_freq_base_train_swa), as HF's config does in rope_local_base_freq.
        "rope_theta": f32(_key(reader, arch, "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10000.0,
        "rope_scaling": rope_scaling(reader, arch, config, tensors),
        "use_bidirectional_attention": False,
    }


def _phi3(reader, arch: str, config: dict, tensors: dict) -> dict:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = int(_key(reader, arch, "rope.dimension_count", head_dim))
    fields = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "head_dim": head_dim,
        "hidden_act": "silu",
        "sliding_window": _key(reader, arch, "attention.sliding_window"),
        "original_max_position_embeddings": int(
            _key(reader, arch, "rope.scaling.original_context_length", config["max_position_embeddings"])
        ),
        **_rope_fields(reader, arch, config, tensors),
    }
    if rotary != head_dim:  # Phi-4-mini rotates 3/4 of each head
        fields["partial_rotary_factor"] = rotary / head_dim
    return fields


_BUILDERS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
}
