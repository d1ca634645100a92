"""Tiny random-weight Llama-family checkpoints built locally (no network), for oracle tests.

Weights are drawn with a larger std than Hugging Face's default init so the logits have clear
margins: greedy comparisons then test the engine, not float rounding at near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 384
_TRAIN_TEXT = (
    "The paged KV cache hands out fixed-size blocks on demand. Continuous batching rebuilds the "
    "batch every iteration: finished requests leave, waiting ones join, and long prompts are "
    "prefilled in chunks between decode steps. Prefix caching shares the blocks of a common prompt. "
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"
)


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([_TRAIN_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def _config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if family == "llama3":  # Llama 3.1 rope scaling, GQA 4:1, tied embeddings
        return LlamaConfig(**{**common, "num_attention_heads": 8, "tie_word_embeddings": True},
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           rope_theta=500000.0)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=48)
    if family == "qwen2":
        return Qwen2Config(**{**common, "num_attention_heads": 6, "hidden_size": 96})
    if family == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32})
    return _config_new_families(family, common)


# Rope scaling and the Gemma / Phi-3 families: every config below makes its feature matter for
# prompts of 3..90 tokens plus generation (windows shorter than the prompt, positions past
# original_max_position_embeddings, softcaps below the scores they cap).
def _config_new_families(family: str, common: dict):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config

    if family == "qwen2-yarn":  # Qwen2.5 past 32k: yarn, factor 4 over an original 32 positions
        return Qwen2Config(**{**common, "num_attention_heads": 6, "hidden_size": 96},
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    if family == "llama-dynamic":  # dynamic NTK past max_position_embeddings=48
        return LlamaConfig(**{**common, "max_position_embeddings": 48},
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    gemma = dict(common, num_attention_heads=4, num_key_value_heads=2, head_dim=256, pad_token_id=0,
                 bos_token_id=2, eos_token_id=1, tie_word_embeddings=True)
    if family == "gemma3":
        # Two local layers, one global, one local; local theta 10k, global 1M with linear scaling.
        return Gemma3TextConfig(
            **{**gemma, "num_hidden_layers": 4}, query_pre_attn_scalar=64, sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    if family == "gemma3-groups":
        # Gemma 3's 5:1 pattern in small: pairs of local layers, then a global one. Layer groups of
        # 2 (core/kv_cache/layout.py): the global pair and two local pairs share 2 cache tensors.
        sliding, full = "sliding_attention", "full_attention"
        return Gemma3TextConfig(
            **{**gemma, "num_hidden_layers": 6}, query_pre_attn_scalar=64, sliding_window=16,
            layer_types=[sliding, sliding, full, sliding, sliding, full],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    if family == "gemma2":
        return Gemma2Config(**{**gemma, "head_dim": 32}, query_pre_attn_scalar=24, sliding_window=16,
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if family == "gemma2-256":  # Gemma 2 2B/9B's head_dim: the decode kernel's vector code
        return Gemma2Config(**gemma, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=2.0,
                            final_logit_softcapping=3.0)
    if family == "phi3":  # longrope past 32 positions, half of each head rotating, a 48-token window
        rot = 8  # head_dim 16 * partial_rotary_factor 0.5
        return Phi3Config(**{**common, "pad_token_id": 0}, partial_rotary_factor=0.5, sliding_window=48,
                          original_max_position_embeddings=32,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(rot // 2)],
                                        "long_factor": [2.0 + 3.0 * i for i in range(rot // 2)]})
    raise ValueError(family)


def build_tiny_model(path: Path, family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Save a random-weight model of `family` (llama, llama3, mistral, qwen2, qwen3) with a tokenizer."""
    from transformers import AutoModelForCausalLM

    config = _config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.25 if p.dim() > 1 else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path
