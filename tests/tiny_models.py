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
