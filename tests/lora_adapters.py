"""Random LoRA adapters in PEFT's on-disk format for a saved test model (no peft needed to write
them): `adapter_config.json` + `adapter_model.safetensors`, tensors named as PeftModel saves them
(`base_model.model.<module path>.lora_A.weight` [r, in], `.lora_B.weight` [out, r]).

B is drawn non-zero (PEFT initialises it to zero, which would make every adapter the base model),
large enough that an adapter's greedy tokens differ from the base model's and from each other's:
a server that ran the wrong adapter, or none, then gives other tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection a Llama-family decoder layer has."""
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_peft_adapter(path: Path, model_dir: Path, seed: int, rank: int = 8, alpha: int = 16,
                       target_modules: tuple[str, ...] = (*ATTENTION, *MLP), scale: float = 0.5) -> Path:
    """A random adapter for the model in `model_dir`, written to `path` (created); returns it."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = _shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            block = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "target_modules": list(target_modules), "modules_to_save": None,
        "inference_mode": True}, indent=2))
    return path
