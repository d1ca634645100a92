"""GGUF files -> Hugging Face model folders, converted once into the cache.

    metadata.py    open a file (truncation checks), read keys, the supported architectures
    names.py       GGUF -> HF tensor names per architecture
    hf_config.py   GGUF metadata -> config.json per architecture (rope.py: RoPE scaling)
    dequant.py     supported storage types, dequantization through the `gguf` package
    transforms.py  undo llama.cpp's value changes (q/k permutation, Gemma's norm + 1)
    tokenizer.py   tokenizer files and chat template from the file's metadata
    convert.py     one file -> one folder;  cache.py  convert once, atomically, under a lock
"""

from pagedserve.core.models.gguf.cache import ensure_gguf_model
from pagedserve.core.models.gguf.dequant import SUPPORTED_TYPES
from pagedserve.core.models.gguf.metadata import SUPPORTED_ARCHITECTURES, CorruptModelFile

__all__ = ["ensure_gguf_model", "SUPPORTED_TYPES", "SUPPORTED_ARCHITECTURES", "CorruptModelFile"]
