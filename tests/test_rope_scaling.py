"""Rope scaling against transformers' own rope code (the oracle): the inverse frequencies and
attention factors of every supported type equal transformers' ROPE_INIT_FUNCTIONS bit for bit, and
the per-token cos/sin rows of the length-dependent types (longrope, dynamic NTK) equal what
transformers' rotary modules produce for a sequence of that length."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.errors import UnsupportedModel
from pagedserve.core.layers.rotary import RotaryEmbedding, compute_inv_freq
from pagedserve.core.models.arch import ModelArch

HEAD_DIM = 64

# (name, config class name, rope_parameters, extra config kwargs)
CASES = [
    ("linear", "LlamaConfig", {"rope_type": "linear", "factor": 4.0}, {}),
    ("llama3", "LlamaConfig", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}, {}),
    ("yarn", "Qwen2Config", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, {}),
    ("yarn-mscale", "LlamaConfig", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2}, {}),
    ("yarn-no-truncate", "LlamaConfig", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                         "truncate": False, "attention_factor": 1.25}, {}),
    ("dynamic", "LlamaConfig", {"rope_type": "dynamic", "factor": 2.0}, {}),
    ("longrope", "Phi3Config", {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(32)],
                                "long_factor": [1.5 + 0.5 * i for i in range(32)]},
     {"original_max_position_embeddings": 64}),
    ("longrope-partial", "Phi3Config", {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(24)],
                                        "long_factor": [1.5 + 0.5 * i for i in range(24)]},
     {"original_max_position_embeddings": 64, "partial_rotary_factor": 0.75}),
    ("default-partial", "Phi3Config", {"rope_type": "default"}, {"partial_rotary_factor": 0.5}),
]


def hf_config(cls_name: str, rope: dict, extra: dict):
    import transformers

    cls = getattr(transformers, cls_name)
    kwargs = dict(hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=10000.0, vocab_size=128, intermediate_size=64, num_hidden_layers=1, pad_token_id=0)
    return cls(**kwargs, **extra, rope_scaling=dict(rope))


@pytest.mark.parametrize("name,cls_name,rope,extra", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seq_len", [None, 200, 1000])
def test_inv_freq_equals_transformers(name, cls_name, rope, extra, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(cls_name, rope, extra)
    params = config.rope_parameters
    rope_type = params["rope_type"]
    if rope_type == "default":
        want = (1.0 / (10000.0 ** (torch.arange(0, int(HEAD_DIM * params["partial_rotary_factor"]), 2,
                                                  dtype=torch.int64).float() / int(HEAD_DIM * params["partial_rotary_factor"]))), 1.0)
    else:
        # transformers passes a tensor (torch.max(position_ids) + 1) in the forward, None at init.
        length = None if seq_len is None else torch.tensor(seq_len)
        want = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=length)
    got = compute_inv_freq(HEAD_DIM, 10000.0, params, config.max_position_embeddings, seq_len)
    assert torch.equal(got[0], want[0].float()), f"{name}: inverse frequencies differ"
    assert got[1] == pytest.approx(float(want[1]), rel=0, abs=0), f"{name}: attention factor differs"


@pytest.mark.parametrize("case", ["longrope", "longrope-partial", "dynamic"])
@pytest.mark.parametrize("length", [40, 64, 65, 256, 300])
def test_rows_equal_transformers_rotary_module(case, length):
    """cos/sin of every position of a sequence of `length` tokens, as transformers' rotary module
    computes them in one forward (a fresh module: dynamic NTK keeps state between calls)."""
    import transformers

    _, cls_name, rope, extra = next(c for c in CASES if c[0] == case)
    config = hf_config(cls_name, rope, extra)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    rotary = model_cls(config).model.rotary_emb
    positions = torch.arange(length)[None]
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(HEAD_DIM, 512, 10000.0, config.rope_parameters, torch.device("cpu"),
                           config.max_position_embeddings)
    cos, sin, index = ours.rows(positions[0], torch.full((length,), length))
    assert torch.equal(cos[index], want_cos[0]) and torch.equal(sin[index], want_sin[0])


def test_rows_follow_each_tokens_own_length():
    """One batch, two requests: a longrope token switches to the long factors by its own length."""
    _, cls_name, rope, extra = next(c for c in CASES if c[0] == "longrope")
    config = hf_config(cls_name, rope, extra)
    ours = RotaryEmbedding(HEAD_DIM, 512, 10000.0, config.rope_parameters, torch.device("cpu"), 256)
    positions = torch.tensor([10, 10, 70])
    cos, _, index = ours.rows(positions, torch.tensor([20, 100, 71]))
    assert torch.equal(cos[index[0]], ours.cos[10]) and torch.equal(cos[index[1]], ours.cos[512 + 10])
    assert not torch.equal(cos[index[0]], cos[index[1]]) and torch.equal(cos[index[2]], ours.cos[512 + 70])
    assert ours.prefix_cache_key(64) is None and ours.prefix_cache_key(65) == "longrope:long"


def test_unsupported_rope_type_is_named():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, vocab_size=64, intermediate_size=64, num_hidden_layers=1,
                         architectures=["LlamaForCausalLM"])
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModel, match="rope type 'mrope' is not supported"):
        ModelArch.from_hf_config(config)


def test_unsupported_config_features_are_named():
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, vocab_size=64, intermediate_size=64,
                              num_hidden_layers=1, use_bidirectional_attention=True,
                              architectures=["Gemma3ForCausalLM"])
    with pytest.raises(UnsupportedModel, match="use_bidirectional_attention"):
        ModelArch.from_hf_config(config)


def test_multimodal_gemma3_without_text_config_is_refused():
    """Gemma3ForConditionalGeneration runs as its text_config's decoder (tests/test_gemma3_multimodal.py);
    a config that names the class but nests no text_config is refused saying so."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, vocab_size=64, intermediate_size=64,
                              num_hidden_layers=1, architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(UnsupportedModel, match="has no text_config"):
        ModelArch.from_hf_config(config)
