"""GGUF tensor data -> float32 numpy arrays, through the `gguf` package's own dequantizers.

Every type the `gguf` package can dequantize is accepted; anything else (a type a newer llama.cpp
added, integer tensors) is refused by name with the list of what is accepted.
"""

from __future__ import annotations

import numpy as np

from pagedserve.core.errors import UnsupportedModel

# Float types are read as they are; the quantized ones are every block format gguf.quants decodes
# (tests/test_gguf_dequant.py checks this list against the installed `gguf`).
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
)  # fmt: skip
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES


def check_type(tensor) -> None:
    """Refuse a tensor whose storage type is not in SUPPORTED_TYPES, naming both."""
    name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
    if name not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"GGUF tensor {tensor.name!r} is stored as {name}, which pagedserve cannot dequantize; "
            f"supported types: {', '.join(SUPPORTED_TYPES)}"
        )


def dequantize(tensor) -> np.ndarray:
    """A `gguf.ReaderTensor` as float32 in numpy/torch dimension order (out_features first)."""
    import gguf

    check_type(tensor)
    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    # GGUF lists dims fastest-moving first (ne0 = in_features); numpy/torch order is reversed.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if values.size != int(np.prod(shape)):
        raise UnsupportedModel(f"GGUF tensor {tensor.name!r} dequantized to {values.size} values, expected {shape}")
    return values.reshape(shape)


Q8_0_BLOCK_BYTES = 34  # one fp16 scale, then 32 int8 codes


def q8_0_blocks(tensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 matrix as stored, undecoded: (codes int8 [out, in], scales float16 [out, in / 32]), so
    `quantization: int8` can keep its blocks as they are (kernels/reference/int8_linear.py: from_q8_0)."""
    out_features, in_features = (int(d) for d in reversed(tensor.shape))
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(out_features, in_features // 32, Q8_0_BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(out_features, in_features // 32)
    codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(out_features, in_features)
    return codes, scales
