"""Greedy token ids equal transformers generate() across every engine toggle (DESIGN rule 2)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def make_engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", **overrides}))


def random_prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(1, 384, (length,), generator=g).tolist() for length in lengths]


def assert_all_free(engine: LLMEngine) -> None:
    engine.kv_cache_manager.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def run_staggered(engine: LLMEngine, prompts, max_tokens: list[int], arrivals: list[int]) -> dict[str, list[int]]:
    """Add request i at step arrivals[i]; step until everything finished; return tokens per id."""
    tokens: dict[str, list[int]] = {}
    step = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    max_running = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True))
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        max_running = max(max_running, engine.stats.num_running)
        engine.kv_cache_manager.check_invariants()
        step += 1
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size,budget", [(1, 64), (16, 37), (16, 2048)])
def test_greedy_matches_transformers(tiny_model_dir, family, block_size, budget):
    """Batches of different lengths arriving together; budget 37 cuts prompts mid-block."""
    path = tiny_model_dir(family)
    engine = make_engine(path, block_size=block_size, max_num_batched_tokens=budget)
    prompts = random_prompts(6, 3, 70, seed=FAMILIES.index(family) * 100 + block_size)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == hf_greedy(path, prompt, 20), f"prompt of {len(prompt)} tokens"
        assert res.finish_reason == "length"
    assert_all_free(engine)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_forty_requests_arriving_at_different_steps(tiny_model_dir, family):
    path = tiny_model_dir(family)
    engine = make_engine(path, block_size=16, max_num_batched_tokens=96, max_num_seqs=24)
    prompts = random_prompts(40, 1, 90, seed=7)
    g = torch.Generator().manual_seed(3)
    max_tokens = torch.randint(1, 25, (40,), generator=g).tolist()
    arrivals = torch.randint(0, 30, (40,), generator=g).tolist()
    tokens = run_staggered(engine, prompts, max_tokens, arrivals)
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(path, prompt, max_tokens[i]), f"request {i}"
    assert engine.stats.num_preemptions_total == 0
    assert_all_free(engine)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_preemption_keeps_outputs_unchanged(tiny_model_dir, family, block_size):
    """A pool far too small for the batch forces preemption by recompute; outputs are unchanged."""
    path = tiny_model_dir(family)
    tokens_in_pool = 160
    engine = make_engine(path, block_size=block_size, num_kv_blocks=tokens_in_pool // block_size,
                         max_num_batched_tokens=64)
    prompts = random_prompts(10, 20, 60, seed=11)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert engine.stats.num_preemptions_total > 0, "the scenario must force preemption"
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == hf_greedy(path, prompt, 40)
    assert_all_free(engine)


def test_eos_stops_generation(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path)
    prompt = random_prompts(1, 10, 10, seed=5)[0]
    expected = hf_greedy(path, prompt, 30)
    eos = expected[7]  # pretend the 8th greedy token is EOS
    engine.eos_token_id = eos
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    first = expected.index(eos)
    assert list(res.token_ids) == expected[: first + 1]
    assert res.finish_reason == "stop"
    assert_all_free(engine)


def test_abort_frees_blocks_at_once(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), block_size=4)
    prompts = random_prompts(3, 30, 40, seed=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = engine.kv_cache_manager.num_used_blocks
    (out,) = engine.abort_request("a1")
    assert out.finished and out.finish_reason == "abort" and out.request_id == "a1"
    assert engine.kv_cache_manager.num_used_blocks < used
    engine.kv_cache_manager.check_invariants()
    assert engine.abort_request("a1") == []
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_temperature_sampling_is_seeded_and_valid(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"))
    prompts = random_prompts(4, 5, 30, seed=9)
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=123)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts[:1], params)
    assert a[0].token_ids == b[0].token_ids  # same seed, different batch: same tokens
    assert all(0 <= t < engine.arch.vocab_size for r in a for t in r.token_ids)
    greedy = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert a[0].token_ids != greedy[0].token_ids or a[1].token_ids != a[2].token_ids
    assert_all_free(engine)


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen3"])
def test_greedy_matches_transformers_on_an_avx2_cpu(tiny_model_dir, monkeypatch, family):
    """The kernel choice of a CPU with AVX2 but no AVX-512: fp32 layers (the tied LM head too) take
    the AVX2 linear kernel, prefill rows the AVX2 prefill attention (head_dim a multiple of 32; the
    SDPA otherwise). Their sums are the AVX-512 kernels', so the greedy ids are transformers' too."""
    from pagedserve.kernels.cpu import linear as cpu_linear
    from pagedserve.kernels.cpu.build import load_extension

    if cpu_linear.AVX2_FP32 not in cpu_linear.runnable_kernels(torch.float32):
        pytest.skip("this CPU has no AVX2 with FMA")
    runs_here = cpu_linear._runs_here
    monkeypatch.setattr(cpu_linear, "_runs_here", lambda k: runs_here(k) and not k.available.startswith("avx512"))
    cpu_linear._available.cache_clear()
    try:
        path = tiny_model_dir(family)
        engine = make_engine(path, block_size=16, max_num_batched_tokens=37)
        assert engine.runner.model.lm_head[0].kernel.kernel is cpu_linear.AVX2_FP32
        ext, prefills = load_extension(), []
        avx2_prefill = ext.paged_prefill_attention_avx2
        monkeypatch.setattr(ext, "paged_prefill_attention_avx2", lambda *a: prefills.append(1) or avx2_prefill(*a))
        monkeypatch.setattr(ext, "paged_prefill_attention", None)  # AVX-512's entry: never called here
        prompts = random_prompts(6, 3, 70, seed=31)
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        assert bool(prefills) == (engine.runner.model.arch.head_dim % 32 == 0)  # the kernel's head_dims (qwen3's)
        for prompt, res in zip(prompts, results):
            assert list(res.token_ids) == hf_greedy(path, prompt, 20), f"prompt of {len(prompt)} tokens"
        assert_all_free(engine)
    finally:
        monkeypatch.undo()
        cpu_linear._available.cache_clear()


def test_lm_head_in_vocabulary_slices_matches_transformers(tiny_model_dir, monkeypatch):
    """On a CPU whose backend packs no fp32 LM head (no AVX-512) it runs over vocabulary slices
    (1024 rows for real models); slices of 100 split the tiny 384-token vocabulary unevenly, and
    the greedy ids must not change. The backend's packing is turned off to take that path here."""
    import pagedserve.core.models.llama as llama
    import pagedserve.kernels.cpu as cpu_kernels

    monkeypatch.setattr(llama, "CPU_LM_HEAD_SLICE", 100)
    monkeypatch.setattr(cpu_kernels, "prepack_linear", lambda weight: None)
    path = tiny_model_dir("llama3")  # tied embeddings: the slices are views of the embedding
    engine = make_engine(path)
    assert len(engine.runner.model.lm_head) == 4
    prompts = random_prompts(5, 3, 40, seed=17)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == hf_greedy(path, prompt, 16)
    assert_all_free(engine)
