"""What transformers makes of a GGUF file: the independent oracle for the converter's tests.

`load_gguf_checkpoint` is the code behind `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`
(called directly: from_pretrained insists on `accelerate` for GGUF files, which is not installed).
"""

from __future__ import annotations

from pathlib import Path

import torch


def transformers_gguf(path: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, HF name -> float32 tensor) as transformers loads the file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
    # The weight names come from the model class's modules mapped through gguf-py's table for its
    # model_type, and gguf-py has no "mistral" table (llama.cpp writes Mistral as llama), so a
    # Mistral file's names are taken from a Llama model: its modules and names are the same.
    names_from = AutoConfig.for_model(**{**config.to_dict(), "model_type": "llama"}) if config.model_type == "mistral" else config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(names_from)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return config, {name: t.float() for name, t in tensors.items()}
