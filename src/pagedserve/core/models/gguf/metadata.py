"""Opening a GGUF file and reading its metadata, with clear errors for files that are not whole."""

from __future__ import annotations

from pathlib import Path

from pagedserve.core.errors import UnsupportedModel

# GGUF `general.architecture` values pagedserve converts (Mistral files say "llama").
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


class CorruptModelFile(UnsupportedModel):
    """The model file is truncated or is not a valid file of its format."""


def open_gguf(path: Path):
    """A `gguf.GGUFReader` for `path`; a truncated or malformed file raises CorruptModelFile."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors, ... by case
        raise CorruptModelFile(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be truncated "
            "(an interrupted download) or not a GGUF file at all: download it again"
        ) from exc
    # The reader maps tensor data lazily: one that extends past the end of the file shows up as a
    # short array rather than an error, so check every tensor's byte count here.
    for tensor in reader.tensors:
        if tensor.data.nbytes != int(tensor.n_bytes):
            raise CorruptModelFile(
                f"{path} is truncated: tensor {tensor.name!r} needs {int(tensor.n_bytes)} bytes, the "
                f"file holds {tensor.data.nbytes}; download the file again"
            )
    return reader


def field(reader, key: str, default=None):
    """A metadata value as a Python scalar/str/list, or `default` when the key is absent."""
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores floats as float32).

    1e-5 comes back from the file as 9.99999974e-06; this restores the value config.json had.
    """
    import numpy as np

    return float(str(np.float32(value)))


def architecture(reader, path: Path) -> str:
    """The file's `general.architecture`, refused unless pagedserve converts it."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"{path.name}: GGUF architecture {arch!r} is not supported; pagedserve converts "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Mistral files use 'llama')"
        )
    return arch
