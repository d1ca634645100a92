"""Multi-LoRA in the engine against PEFT (tests/lora_oracle.py): each adapter's greedy tokens in a
mixed batch equal PeftModel's and the same request run alone; base rows equal transformers'."""

from __future__ import annotations

import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.lora_oracle import make_adapter, peft_greedy
from tests.oracle import hf_greedy

MAX_TOKENS = 8
PROMPTS = ([5, 17, 42, 99, 100, 7, 8], [3, 9, 27, 81, 243, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67],
           [250, 251, 252])
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen3 and three adapters: all seven projections (r 8), q/v/down with rslora (r 4),
    o/gate/up at the largest rank (r 16)."""
    base = tiny_model_dir("qwen3")
    root = tmp_path_factory.mktemp("qwen3-loras")
    adapters = {
        "all": make_adapter(base, root / "all", r=8, alpha=16, seed=1),
        "qvd": make_adapter(base, root / "qvd", r=4, alpha=8, seed=2, use_rslora=True,
                            targets=("q_proj", "v_proj", "down_proj")),
        "mlp": make_adapter(base, root / "mlp", r=16, alpha=32, seed=3, targets=("o_proj", "gate_proj", "up_proj")),
    }
    return base, adapters


def make_engine(base, adapters, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig.from_dict({
        "model": str(base), "dtype": "float32", "enable_lora": True, "max_loras": 3,
        "lora_modules": {k: str(v) for k, v in adapters.items()}, **overrides}))


def run(engine: LLMEngine, requests: list[tuple[list[int], str | None]], on_step=None) -> list[list[int]]:
    """Add every request before the first step; step to the end; tokens per request in order."""
    ids = [engine.add_request(None, prompt, GREEDY, lora_name=name) for prompt, name in requests]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if on_step is not None:
            on_step(engine)
    engine.kv_cache_manager.check_invariants()
    return [tokens[i] for i in ids]


def mixed_requests() -> list[tuple[list[int], str | None]]:
    names = ["all", "qvd", None, "mlp"]
    return [(list(p), names[(i + j) % len(names)]) for i, p in enumerate(PROMPTS) for j in range(2)]


def expected(base, adapters, prompt, name) -> list[int]:
    if name is None:
        return hf_greedy(base, prompt, MAX_TOKENS)
    return peft_greedy(base, adapters[name], prompt, MAX_TOKENS)


def test_mixed_batch_matches_peft_and_solo_runs(qwen3):
    base, adapters = qwen3
    engine = make_engine(base, adapters)
    requests = mixed_requests()
    first_step_adapters = []
    mixed = run(engine, requests, on_step=lambda e: first_step_adapters.append(e.lora_stats().running))
    assert set(first_step_adapters[0]) == {"all", "qvd", "mlp"}  # three adapters and base rows in one step
    for (prompt, name), got in zip(requests, mixed):
        assert got == expected(base, adapters, prompt, name), (name, prompt)
        assert run(engine, [(prompt, name)]) == [got]
    # The adapters change the output (else the comparison proves nothing).
    assert len({tuple(expected(base, adapters, PROMPTS[1], n)) for n in (None, "all", "qvd", "mlp")}) == 4


def test_eviction_beyond_max_loras_keeps_tokens_exact(qwen3):
    """max_loras=1: one adapter per step (others wait), slots reloaded LRU; max_cpu_loras=1 too:
    host weights dropped and read again from their directories."""
    base, adapters = qwen3
    engine = make_engine(base, adapters, max_loras=1, max_cpu_loras=1)
    requests = mixed_requests()
    per_step = []
    got = run(engine, requests, on_step=lambda e: per_step.append(e.lora_stats().running))
    assert all(len(running) <= 1 for running in per_step)
    assert engine.runner.lora.num_loads >= 3
    for (prompt, name), tokens in zip(requests, got):
        assert tokens == expected(base, adapters, prompt, name), (name, prompt)


def test_prefix_cache_never_crosses_adapters(qwen3):
    base, adapters = qwen3
    engine = make_engine(base, adapters, block_size=4)
    prompt = list(PROMPTS[1])

    def cached(name):
        rid = engine.add_request(None, prompt, GREEDY, lora_name=name)
        request = engine._requests[rid].samples[0]
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        return request.num_cached_tokens, tokens

    assert cached(None)[0] == 0
    hits, tokens = cached("all")
    assert hits == 0 and tokens == expected(base, adapters, prompt, "all")
    hits, tokens = cached("qvd")
    assert hits == 0 and tokens == expected(base, adapters, prompt, "qvd")
    hits, tokens = cached("all")  # its own blocks are reused, with the same tokens
    assert hits > 0 and tokens == expected(base, adapters, prompt, "all")
    hits, tokens = cached(None)
    assert hits > 0 and tokens == expected(base, adapters, prompt, None)


def test_removed_adapter_finishes_its_requests_and_takes_no_more(qwen3):
    from pagedserve.core.errors import UnknownLoRAAdapter

    base, adapters = qwen3
    engine = make_engine(base, {"all": adapters["all"]})
    rid = engine.add_request(None, PROMPTS[0], GREEDY, lora_name="all")
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    assert engine.remove_lora("all") is True
    assert engine.remove_lora("all") is False
    assert engine.list_loras() == {}
    with pytest.raises(UnknownLoRAAdapter, match="'all' is not loaded"):
        engine.add_request(None, PROMPTS[0], GREEDY, lora_name="all")
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids if out.request_id == rid]
    assert tokens == expected(base, adapters, PROMPTS[0], "all")
    # Loaded again (a new adapter as far as the engine is concerned): same tokens as PEFT.
    engine.add_lora("again", str(adapters["all"]))
    assert run(engine, [(PROMPTS[0], "again")]) == [expected(base, adapters, PROMPTS[0], "all")]
