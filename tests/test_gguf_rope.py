"""RoPE scaling read from GGUF metadata and factor tensors -> HF rope_scaling (gguf/rope.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_fixtures import HEAD_DIM, write_gguf
from pagedserve.core.errors import UnsupportedModel
from pagedserve.core.models.gguf.hf_config import build_config
from pagedserve.core.models.gguf.metadata import open_gguf
from pagedserve.core.models.gguf.rope import llama3_factors


def _config(path):
    reader = open_gguf(path)
    return build_config(reader, "llama", {t.name: t for t in reader.tensors})


def test_linear_and_yarn_from_metadata(tmp_path):
    linear = write_gguf(tmp_path / "linear.gguf", "llama", metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0})
    assert _config(linear)["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    yarn = write_gguf(tmp_path / "yarn.gguf", "llama", metadata={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 32768})
    assert _config(yarn)["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768}
    assert _config(write_gguf(tmp_path / "plain.gguf", "llama"))["rope_scaling"] is None


def test_unknown_scaling_type_is_refused(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "llama", metadata={"llama.rope.scaling.type": "dynamic"})
    with pytest.raises(UnsupportedModel, match="'dynamic'.*linear, yarn"):
        _config(path)


def test_llama3_rope_freqs_give_transformers_the_same_frequencies(tmp_path):
    """Oracle: transformers' own llama3 RoPE init on our config must give llama.cpp's frequencies,
    base frequencies divided by the rope_freqs tensor."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factors = llama3_factors(HEAD_DIM, 10000.0, 8.0, 1.0, 4.0, 8192)
    assert 1.0 < factors.max() and factors.min() == 1.0  # the file really scales some frequencies
    path = write_gguf(tmp_path / "l3.gguf", "llama", extra_tensors={"rope_freqs.weight": factors})
    config = _config(path)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == 8.0
    hf = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "rope_scaling")})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    np.testing.assert_allclose(inv_freq.double().numpy(), (base / torch.from_numpy(factors).double()).numpy(),
                               rtol=1e-5)

    other = write_gguf(tmp_path / "l3x.gguf", "llama", extra_tensors={"rope_freqs.weight": factors[::-1].copy()})
    with pytest.raises(UnsupportedModel, match="rope_freqs do not match Llama 3"):
        _config(other)
