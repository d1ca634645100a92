"""The embedded SmolLM2-135M-Instruct: real prompts, token-exact against transformers (slow)."""

from __future__ import annotations

import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Explain in one sentence why the sky is blue.",
    "Write a short poem about a cat who loves boxes.",
    "List three uses for a paperclip.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def engine():
    # fp32 so the comparison with transformers (fp32) is exact; a 37-token budget chunks prompts.
    return LLMEngine(EngineConfig.from_dict(
        {"model": "default", "dtype": "float32", "max_num_batched_tokens": 37, "max_model_len": 2048}))


def test_chat_template_renders_like_transformers(engine):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = AutoTokenizer.from_pretrained(engine.model_path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    text = engine.apply_chat_template(messages)
    assert text == expected and "Be brief." in text and text.rstrip().endswith("assistant")
    with pytest.raises(InvalidRequest, match=r"messages\[1\]"):
        engine.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user"}])


def test_real_prompts_match_transformers(engine):
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for res in results:
        assert list(res.token_ids) == hf_greedy(engine.model_path, res.prompt_token_ids, 24)
    assert "Paris" in results[0].text
    engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
