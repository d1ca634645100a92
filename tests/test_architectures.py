"""Gemma 3 (text), Gemma 2, Phi-3 and the rope scalings (yarn, dynamic NTK, longrope, partial
rotary): greedy token ids equal transformers generate() in fp32 (DESIGN rule 2), on tiny random
configs built so that each feature matters (tests/tiny_models.py: sliding windows of 16 and 48
tokens under prompts of up to 90, positions past original_max_position_embeddings=32 or
max_position_embeddings=48, softcaps of 2 and 3 below the values they cap), with chunked prefill,
several block sizes, prefix caching and both CPU kernel backends."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy
from tests.test_engine_vs_transformers import assert_all_free, random_prompts

FAMILIES = ["gemma3", "gemma2", "phi3", "qwen2-yarn", "llama-dynamic"]
MAX_NEW = 24


def make_engine(path, family: str, **overrides) -> LLMEngine:
    # The dynamic-NTK model's max_position_embeddings is 48: its scaling is what serves longer sequences.
    extra = {"max_model_len": 256} if family == "llama-dynamic" else {}
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", **extra, **overrides}))


def oracle(path, family: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    if family == "llama-dynamic":
        return hf_greedy_fresh(path, prompt, max_new_tokens)
    return hf_greedy(path, prompt, max_new_tokens)


def hf_greedy_fresh(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers generate() on a freshly loaded model: dynamic NTK keeps the longest length it
    has seen inside the rotary module between calls, so a shared model would not be an oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend,block_size,budget", [("reference", 16, 2048), ("cpu", 16, 37)])
def test_greedy_matches_transformers(tiny_model_dir, family, backend, block_size, budget):
    """Prompts of 3..90 tokens arriving together; budget 37 cuts prompts into chunks mid-block."""
    path = tiny_model_dir(family)
    engine = make_engine(path, family, attention_backend=backend, block_size=block_size,
                         max_num_batched_tokens=budget)
    prompts = random_prompts(4, 3, 90, seed=FAMILIES.index(family) * 10 + block_size)
    # Phi-3: prompts past 32 run on the long factors throughout; an 8-token prompt plus 24 new
    # tokens stays on the short ones (tests/test_longrope_switch.py crosses 32 while generating).
    prompts[0] = prompts[0][:8] if family == "phi3" else prompts[0][:20]
    if family == "phi3":
        prompts[1:] = [p * (32 // len(p) + 1) for p in prompts[1:]]  # all past 32
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == oracle(path, family, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert_all_free(engine)


@pytest.mark.parametrize("family", ["gemma3", "phi3", "llama-dynamic"])
def test_prefix_cache_hits_stay_exact(tiny_model_dir, family):
    """Prompts sharing a 40-token prefix, run one after another so later ones hit the cache: a
    sliding window masks by absolute position, and a length-dependent rope (longrope across its
    switch, dynamic NTK past 48) only shares blocks between prompts rotated alike."""
    path = tiny_model_dir(family)
    engine = make_engine(path, family, attention_backend="cpu", block_size=8, max_num_batched_tokens=32,
                         enable_prefix_caching=True)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 384, (40,), generator=g).tolist()
    tails = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (0, 30, 30, 9)]
    prompts = [prefix[:8]] + [prefix + t for t in tails]  # 8 (short throughout), 40, 70, 70, 49 tokens
    for prompt in prompts:
        res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))[0]
        assert list(res.token_ids) == oracle(path, family, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert engine.stats.prefix_cache_hits_total > 0, "no prompt hit the prefix cache: the test would not test it"
    assert_all_free(engine)


@pytest.mark.parametrize("family", ["gemma2", "gemma2-256"])
def test_gemma2_softcapped_attention_runs_in_the_cpp_kernels(tiny_model_dir, family, monkeypatch):
    """Gemma 2's capped scores inside the C++ decode and prefill kernels (the reference paths
    refused): prompts of 20..90 tokens under a window of 16, chunked by a 37-token budget; greedy
    tokens equal transformers'. head_dim 32 takes the decode kernel's any-head_dim code, 256 its
    vector code; prefill rows take the prefill kernel where the CPU has AVX-512 or AVX2."""
    from pagedserve.kernels import cpu

    path = tiny_model_dir(family)
    engine = make_engine(path, "gemma2", attention_backend="cpu", block_size=16, max_num_batched_tokens=37)

    def refuse(*args, **kwargs):
        raise AssertionError("softcapped attention fell back to the reference")

    monkeypatch.setattr(cpu.attention.reference, "paged_attention", refuse)
    if cpu.attention._prefill_kernel(torch.empty(1, 1, 32), torch.empty(1, 1, 32)) is not None:
        monkeypatch.setattr(cpu.attention, "prefill_attention", refuse)
    prompts = random_prompts(4, 20, 90, seed=13)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == hf_greedy(path, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert_all_free(engine)


@pytest.mark.parametrize("family", ["gemma2", "gemma2-256"])
def test_gemma2_softcaps_cap(tiny_model_dir, family):
    """The softcaps act in these configs (the outputs change without them), and the engine's
    logprobs, which the final softcap shapes, equal transformers' to fp32 rounding."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(family)
    prompt = random_prompts(1, 60, 60, seed=11)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        capped = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        model.config.final_logit_softcapping = None
        uncapped_final = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped_both = model(torch.tensor([prompt])).logits[0, -1]
    assert (capped - uncapped_final).abs().max() > 0.5, "the final softcap does not act"
    assert (torch.log_softmax(uncapped_both, -1) - uncapped_final).abs().max() > 0.5, "the attention softcap does not act"
    engine = make_engine(path, "gemma2", attention_backend="cpu")
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True))[0]
    top = res.logprobs[0].top
    want = capped.topk(5)
    assert [t for t, _ in top] == want.indices.tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp in top]), want.values, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_reused_logits_buffer_stays_exact(tiny_model_dir, family, monkeypatch):
    """The LM head writes large logits into one buffer kept from step to step (llama.py,
    REUSED_LOGITS_MIN_BYTES: Gemma 3's vocabulary). Forced on for a tiny model's small logits,
    with requests joining and leaving so the rows per step change: the same greedy tokens as
    transformers, and the buffer was in use (kept, grown to the most rows a step had). Greedy-only
    steps skip the logits (LlamaDecoder.greedy_tokens), so the runner is kept on the logits path."""
    from pagedserve.core.models import llama
    from pagedserve.core.sampler import Sampler

    monkeypatch.setattr(llama, "REUSED_LOGITS_MIN_BYTES", 0)
    monkeypatch.setattr(Sampler, "greedy_only", staticmethod(lambda *args: False))
    path = tiny_model_dir(family)
    engine = make_engine(path, family, attention_backend="cpu", max_num_batched_tokens=40)
    prompts = random_prompts(5, 3, 60, seed=7)
    lengths = [MAX_NEW, 5, 17, 9, MAX_NEW]
    results = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                        for n in lengths])
    for prompt, res, n in zip(prompts, results, lengths):
        assert list(res.token_ids) == oracle(path, family, prompt, n), f"prompt of {len(prompt)} tokens"
    kept = engine.runner.model._logits
    assert kept is not None and kept.shape[0] >= 2
    assert_all_free(engine)
