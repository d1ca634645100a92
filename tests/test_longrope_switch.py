"""Phi-3 longrope across its switch: a sequence whose prompt fits original_max_position_embeddings
(32 in tests/tiny_models.py's phi3) and that grows past it while generating. transformers' Phi-3
generate() then discards its cache and recomputes every token with the long factors; pagedserve
restarts the sample from position 0 on the long factors (Scheduler._switch_to_long_rope), so greedy
tokens equal transformers' (fp32, token-exact) with chunked recompute, prefix caching, preemption
around the switch and both attention backends."""

from __future__ import annotations

import pytest

from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy
from tests.test_architectures import make_engine
from tests.test_engine_vs_transformers import assert_all_free, random_prompts

SWITCH = 32
MAX_NEW = 24


def crossing_prompts() -> list[list[int]]:
    """Prompts that cross 32 while generating 24 tokens (5, 20, 31 and exactly 32 tokens: its first
    new token is computed at position 32), one that stays under (6 + 24 = 30) and one over from
    the start (45)."""
    base = random_prompts(6, 45, 45, seed=21)
    return [base[0][:5], base[1][:20], base[2][:31], base[3][:32], base[4][:6], base[5]]


def greedy(engine, prompts, max_tokens=MAX_NEW):
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [list(r.token_ids) for r in results]


@pytest.mark.parametrize("backend,block_size,budget,prefix", [("cpu", 16, 2048, False), ("cpu", 8, 13, True),
                                                              ("reference", 16, 37, True)])
def test_crossing_the_switch_matches_transformers(tiny_model_dir, backend, block_size, budget, prefix):
    """budget 13: the restart recomputes its 33 tokens in three chunks, mid-block."""
    path = tiny_model_dir("phi3")
    prompts = crossing_prompts()
    engine = make_engine(path, "phi3", attention_backend=backend, block_size=block_size,
                         max_num_batched_tokens=budget, enable_prefix_caching=prefix)
    outputs = greedy(engine, prompts)
    for prompt, out in zip(prompts, outputs):
        assert out == hf_greedy(path, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert_all_free(engine)


def test_the_restart_is_what_makes_it_exact(tiny_model_dir):
    """Without the restart (the tokens before the switch keep their short-factor K/V, pagedserve's
    behaviour before), some crossing sequence's tokens differ from transformers': the test above
    tests the restart."""
    path = tiny_model_dir("phi3")
    prompts = crossing_prompts()[:4]
    engine = make_engine(path, "phi3", attention_backend="cpu")
    engine.scheduler.rope_switch = None
    outputs = greedy(engine, prompts)
    assert any(out != hf_greedy(path, p, MAX_NEW) for p, out in zip(prompts, outputs)), (
        "keeping the short-factor K/V gives transformers' tokens too: the crossing does not matter here")


def test_preemption_around_the_switch(tiny_model_dir):
    """A pool too small for the batch preempts samples before, during and after their restart;
    their recompute rotates by their length then, as transformers would."""
    path = tiny_model_dir("phi3")
    prompts = random_prompts(8, 10, 31, seed=23)
    engine = make_engine(path, "phi3", attention_backend="cpu", block_size=4, num_kv_blocks=40,
                         max_num_batched_tokens=48)
    outputs = greedy(engine, prompts, max_tokens=30)
    assert engine.stats.num_preemptions_total > 0, "the scenario must force preemption"
    for prompt, out in zip(prompts, outputs):
        assert out == hf_greedy(path, prompt, 30), f"prompt of {len(prompt)} tokens"
    assert_all_free(engine)


def test_restarted_blocks_are_shared_only_with_long_prompts(tiny_model_dir):
    """A crossed sample's recomputed blocks carry the long factors' salt: a later prompt past 32
    with the same tokens hits them and stays exact; a short prompt with the same first tokens
    must not (its K/V use the short factors) and stays exact too."""
    path = tiny_model_dir("phi3")
    engine = make_engine(path, "phi3", attention_backend="cpu", block_size=8, enable_prefix_caching=True)
    first = random_prompts(1, 20, 20, seed=25)[0]
    out = greedy(engine, [first])[0]
    assert out == hf_greedy(path, first, MAX_NEW)
    hits = engine.stats.prefix_cache_hits_total
    long_prompt = first + out[:20]  # 40 tokens: the restart computed and cached its first 32+ on long factors
    assert greedy(engine, [long_prompt])[0] == hf_greedy(path, long_prompt, MAX_NEW)
    assert engine.stats.prefix_cache_hits_total - hits >= 32, "the long prompt did not reuse the restart's blocks"
    short_prompt = first + out[:4]  # 24 tokens, short factors: must not read the long blocks
    assert greedy(engine, [short_prompt], max_tokens=4)[0] == hf_greedy(path, short_prompt, 4)
    assert_all_free(engine)
