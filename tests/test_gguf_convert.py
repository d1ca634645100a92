"""GGUF -> Hugging Face conversion for every architecture, against transformers' own GGUF loader.

Small random models are written with gguf's GGUFWriter (tests/gguf_fixtures.py), converted through
the cache, and compared tensor by tensor and field by field with what transformers builds from the
same file (tests/gguf_oracle.py). A few fields transformers gets wrong or leaves at a class
default are checked against the file's metadata instead; each says why.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.gguf_fixtures import HEAD_DIM, HEADS, KV_HEADS, write_gguf
from tests.gguf_oracle import transformers_gguf
from pagedserve.core.models.gguf import ensure_gguf_model

# Storage types mixed into each file: q/k land on quantized types too, so the llama un-permutation
# is checked on dequantized values.
MIXED = ("Q8_0", "Q4_K", "F16", "Q6_K", "F32")

CASES = {
    # id: (GGUF architecture, general.name, tied embeddings, HF class)
    "llama": ("llama", "tiny", False, "LlamaForCausalLM"),
    # llama.cpp writes Mistral 7B as "llama"; transformers (and pagedserve) tell it by general.name.
    "mistral": ("llama", "mistral", False, "MistralForCausalLM"),
    "qwen2": ("qwen2", "tiny", False, "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "tiny", True, "Qwen3ForCausalLM"),
    # Gemma files are always tied: transformers' gemma name map has no output.weight at all.
    "gemma2": ("gemma2", "tiny", True, "Gemma2ForCausalLM"),
    "gemma3": ("gemma3", "tiny", True, "Gemma3ForCausalLM"),
    "phi3": ("phi3", "tiny", False, "Phi3ForCausalLM"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, name, tied, hf_class = CASES[request.param]
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = write_gguf(folder / f"{request.param}.gguf", arch, MIXED, name=name, tied=tied)
    converted = ensure_gguf_model(path, cache_dir=folder / "cache", progress=False)
    return request.param, path, converted, hf_class, transformers_gguf(path)


def test_weights_equal_transformers(case):
    key, path, converted, _, (_, expected) = case
    ours = load_file(str(converted / "model.safetensors"))
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name


def test_config_equals_transformers(case):
    key, path, converted, hf_class, (reference, _) = case
    from transformers import AutoConfig

    raw = json.loads((converted / "config.json").read_text())
    config = AutoConfig.from_pretrained(converted)
    assert raw["architectures"] == [hf_class]
    assert config.model_type == reference.model_type
    same = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
            "bos_token_id", "pad_token_id"]  # fmt: skip
    if key not in ("qwen2", "qwen3", "phi3"):
        # transformers reads no attention.key_length for qwen3 (it keeps Qwen3Config's 128), and
        # Qwen2/Phi3 configs have no head_dim field; the tensor shapes below pin those down instead.
        same.append("head_dim")
    if key.startswith("gemma"):
        same += ["sliding_window", "layer_types", "final_logit_softcapping", "attn_logit_softcapping"]
    assert {k: getattr(config, k) for k in same} == {k: getattr(reference, k) for k in same}
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert raw["rms_norm_eps"] == 1e-6  # the decimal the file's float32 came from
    weights = load_file(str(converted / "model.safetensors"))
    if key == "phi3":
        assert weights["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == (HEADS + 2 * KV_HEADS) * HEAD_DIM
    else:
        assert weights["model.layers.0.self_attn.q_proj.weight"].shape[0] == config.num_attention_heads * config.head_dim
    if key.startswith("gemma"):
        # llama.cpp scales queries by 1/sqrt(head_dim) below 27B; transformers leaves the class default.
        assert config.query_pre_attn_scalar == HEAD_DIM
    if key in ("gemma2", "gemma3", "phi3"):  # the fixtures whose tokenizer sets eot_token_id
        # <end_of_turn> ends a chat turn: it stops generation beside <eos>, as in HF's generation_config.
        assert raw["eos_token_id"] == [reference.eos_token_id, 5]
    else:
        assert config.eos_token_id == reference.eos_token_id
    if key == "phi3":
        assert config.sliding_window == 128  # transformers ignores phi3.attention.sliding_window


def test_tokenizer_matches_transformers_gguf_tokenizer(case):
    _, path, converted, _, _ = case
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(converted)
    samples = ["the whole thing", " hello world", "<|im_start|>user\nthe<|im_end|>\n", "tell<end_of_turn>", "ü 12 \t x"]
    for text in samples:
        assert ours.encode(text) == reference.encode(text), text
    assert ours.chat_template == reference.chat_template and ours.chat_template
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"
