"""PEFT as the independent oracle for LoRA adapters: random adapters saved by PEFT itself, and
PeftModel's greedy tokens."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: Path, out: Path, *, r: int = 8, alpha: float = 16.0, targets=ALL_TARGETS,
                 seed: int = 0, use_rslora: bool = False, std: float = 0.05, **config) -> Path:
    """A random LoRA adapter for the model at `base`, saved by PEFT's save_pretrained. Both A and B
    are random (PEFT starts B at zero, which would make every adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                      lora_dropout=0.0, **config)
    peft_model = get_peft_model(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(out)
    return out


@lru_cache(maxsize=4)
def _peft_model(base: Path, adapter: Path):
    """A PeftModel over a base model of its own: PEFT changes the model it wraps in place, so the
    shared transformers oracle (tests.oracle.hf_model) must never be wrapped."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as tests.oracle.hf_model: exactly max_new_tokens
    return PeftModel.from_pretrained(model, adapter).eval()


def peft_greedy(base: Path, adapter: Path, prompt_ids, max_new_tokens: int) -> list[int]:
    """PeftModel generate(), greedy, EOS ignored: exactly max_new_tokens ids."""
    model = _peft_model(base, adapter)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([list(prompt_ids)]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
