"""Hugging Face transformers as the independent oracle for greedy token ids."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # Ignore EOS by having none: min_new_tokens would instead mask EOS logits, which changes the
    # argmax whenever EOS is the most likely token.
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: Path, prompt_ids: list[int] | tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers generate(), greedy, EOS ignored: exactly max_new_tokens new ids."""
    return list(_hf_greedy_cached(path, tuple(prompt_ids), max_new_tokens))


@lru_cache(maxsize=4096)
def _hf_greedy_cached(path: Path, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0,
        )
    return tuple(out[0, len(prompt_ids):].tolist())
