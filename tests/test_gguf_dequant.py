"""Every storage type the converter accepts decodes to the right values.

Oracle per type: transformers' own torch dequantizer (an implementation independent of gguf's
numpy one) where it has the type; else, for types gguf can quantize, closeness to the floats that
were quantized; F16/BF16 against numpy's own casts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_fixtures import quantized
from pagedserve.core.errors import UnsupportedModel
from pagedserve.core.models.gguf.dequant import SUPPORTED_TYPES, dequantize

ROWS, COLS = 4, 512


def _dequantizable_by_gguf() -> set[str]:
    import gguf

    found = set()
    for qtype in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, 256 // block * size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        found.add(qtype.name)
    return found


def test_supported_types_are_exactly_what_gguf_dequantizes():
    assert set(SUPPORTED_TYPES) == _dequantizable_by_gguf()


class _Tensor:
    """The fields of gguf.ReaderTensor that dequantize() reads."""

    def __init__(self, name, data, qtype, shape):
        self.name, self.data, self.tensor_type, self.shape = name, data, qtype, shape


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_matches_an_independent_decoder(type_name):
    import gguf

    rng = np.random.default_rng(1)
    original = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "BF16":
        data = gguf.quants.quantize(original, qtype)
    else:
        data, _ = quantized(original, type_name, rng)
    ours = dequantize(_Tensor("blk.0.ffn_up.weight", data, qtype, [COLS, ROWS]))
    assert ours.shape == (ROWS, COLS) and ours.dtype == np.float32
    assert np.isfinite(ours).all() and np.abs(ours).sum() > 0

    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    if int(qtype) in GGML_BLOCK:
        expected = torch_dequantize(torch.from_numpy(np.ascontiguousarray(data)).reshape(-1), int(qtype)).numpy()
        np.testing.assert_allclose(ours.reshape(-1), expected, rtol=1e-6, atol=1e-6)
    elif type_name == "F32":
        np.testing.assert_array_equal(ours, original)
    elif type_name == "F16":
        np.testing.assert_array_equal(ours, original.astype(np.float16).astype(np.float32))
    elif type_name == "BF16":
        truncated = torch.from_numpy(original).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(ours, truncated)
    elif type_name in ("Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4"):
        # Quantized by gguf from `original`: the decoded values must track it (ternary types only in
        # sign/zero, as they keep 3 levels per block).
        correlation = np.corrcoef(ours.reshape(-1), original.reshape(-1))[0, 1]
        assert correlation > (0.6 if type_name.startswith("TQ") else 0.95), correlation
    else:  # NVFP4: neither quantizable by gguf nor in transformers; decoded shape/finiteness above
        assert type_name == "NVFP4"


def test_unsupported_type_is_refused_by_name():
    import gguf

    tensor = _Tensor("blk.0.ffn_up.weight", np.zeros((2, 8)), gguf.GGMLQuantizationType.F64, [8, 2])
    with pytest.raises(UnsupportedModel) as err:
        dequantize(tensor)
    message = str(err.value)
    assert "F64" in message and "blk.0.ffn_up.weight" in message
    assert "Q4_K" in message and "Q8_0" in message  # the supported list is named
