"""The embedded SmolLM2-135M-Instruct: real prompts, token-exact against transformers (slow)."""

from __future__ import annotations

import pytest

from oracle import hf_greedy
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

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


def test_real_prompts_match_transformers(engine):
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in PROMPTS]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for res in results:
        assert list(res.token_ids) == hf_greedy(engine.model_path, res.prompt_token_ids, 24)
    assert "Paris" in results[0].text
    engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.num_kv_blocks
