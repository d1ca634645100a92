"""One GGUF file -> one Hugging Face model folder (config.json, model.safetensors, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.core.errors import UnsupportedModel
from pagedserve.core.models.gguf.dequant import check_type, dequantize, q8_0_blocks
from pagedserve.core.models.gguf.hf_config import build_config
from pagedserve.core.models.gguf.metadata import CorruptModelFile, architecture, open_gguf
from pagedserve.core.models.gguf.names import CONFIG_TENSORS, hf_name
from pagedserve.core.models.gguf.tokenizer import write_tokenizer
from pagedserve.core.models.gguf.transforms import to_hf_values


Q8_0_FILE = "gguf-q8_0-blocks.st"
"""Beside model.safetensors: the Q8_0 decoder projections undecoded, `<HF name>.codes` (int8) and
`<HF name>.scales` (fp16 per 32 values), for `quantization: int8` (core/models/loader.py). Not named
*.safetensors: the folder stays a plain HF checkpoint that transformers and the loader read as one."""


def is_projection(hf_tensor_name: str) -> bool:
    """A decoder projection (q/k/v/o, gate/up/down, Phi-3's fused ones): what keeps Q8_0 blocks."""
    return hf_tensor_name.startswith("model.layers.") and hf_tensor_name.endswith("_proj.weight")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True,
                       require_chat_template: bool = False) -> None:
    """Write the Hugging Face folder for `gguf_path` into the existing folder `out_dir`.

    Every check that can refuse the file (architecture, tensor names, storage types, metadata) runs
    before the first tensor is dequantized, so a refusal costs milliseconds, not a conversion.
    Tensors are read with `gguf.GGUFReader` + `gguf.quants.dequantize` directly: transformers'
    own GGUF model loading builds the model first and takes minutes on a small CPU.
    """
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm import tqdm

    gguf_path = Path(gguf_path)
    reader = open_gguf(gguf_path)
    arch = architecture(reader, gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    config = build_config(reader, arch, tensors)
    weights = [t for t in reader.tensors if t.name not in CONFIG_TENSORS]
    names = {t.name: hf_name(arch, t.name) for t in weights}
    for tensor in weights:
        check_type(tensor)

    out, blocks = {}, {}
    label = f"Converting {gguf_path.name}"
    for tensor in tqdm(weights, desc=label, unit="tensor", disable=not progress):
        try:
            values = dequantize(tensor)
        except UnsupportedModel:
            raise
        except Exception as exc:  # malformed block data surfaces here as a numpy error
            raise CorruptModelFile(f"{gguf_path}: tensor {tensor.name!r} cannot be decoded ({exc})") from exc
        out[names[tensor.name]] = np.ascontiguousarray(to_hf_values(arch, tensor.name, values, config))
        if tensor.tensor_type.name == "Q8_0" and is_projection(names[tensor.name]):
            # Rows permuted as the values are (llama's q/k), codes and their scales alike.
            codes, scales = q8_0_blocks(tensor)
            blocks[names[tensor.name] + ".codes"] = np.ascontiguousarray(to_hf_values(arch, tensor.name, codes, config))
            blocks[names[tensor.name] + ".scales"] = np.ascontiguousarray(to_hf_values(arch, tensor.name, scales, config))
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del out
    if blocks:
        save_file(blocks, str(out_dir / Q8_0_FILE), metadata={"format": "pt"})
    del blocks

    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(gguf_path, out_dir, config["max_position_embeddings"], require_chat_template)
