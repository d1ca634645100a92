"""Greedy-only steps: the runner asks the model for the tokens alone (LlamaDecoder.greedy_tokens),
and an LM head kernel with a fused argmax never stores the logits. The tokens must be
transformers' greedy tokens in fp32 (the oracle), whether a step takes that path or the logits
path (a request that asks for logprobs, a final softcap), and the sampler's predicate must only
let through steps where sampling would have been the plain argmax."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.models.llama import LlamaDecoder
from pagedserve.core.sampler import Sampler
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy
from tests.test_architectures import make_engine
from tests.test_engine_vs_transformers import assert_all_free, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def calls(monkeypatch):
    """How often each path ran: greedy_tokens, the logits (any caller), and a fused LM head."""
    counts = {"greedy_tokens": 0, "logits": 0}
    for name in counts:
        original = getattr(LlamaDecoder, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(LlamaDecoder, name, counted)
    return counts


@pytest.mark.parametrize("family,fused", [("llama", True), ("gemma3", True), ("gemma2", False)])
def test_greedy_steps_skip_the_logits(tiny_model_dir, calls, family, fused):
    """Every step greedy-only: tokens from greedy_tokens, the logits never computed except where a
    final softcap (Gemma 2) keeps them; the same tokens as transformers."""
    path = tiny_model_dir(family)
    engine = make_engine(path, family, attention_backend="cpu", max_num_batched_tokens=48)
    prompts = random_prompts(4, 3, 40, seed=11)
    results = engine.generate(prompts, GREEDY)
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == hf_greedy(path, prompt, 12)
    assert calls["greedy_tokens"] > 0
    assert (calls["logits"] == 0) == fused
    assert_all_free(engine)


def test_a_request_asking_for_logprobs_keeps_its_steps_on_the_logits_path(tiny_model_dir, calls):
    """Steps where one row asks for logprobs compute the logits for the batch; the other steps
    take greedy_tokens; every request's tokens are still transformers'."""
    path = tiny_model_dir("llama")
    engine = make_engine(path, "llama", attention_backend="cpu")
    prompts = random_prompts(3, 5, 30, seed=12)
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1), GREEDY]
    results = engine.generate(prompts, params)
    for prompt, res, p in zip(prompts, results, params):
        assert list(res.token_ids) == hf_greedy(path, prompt, p.max_tokens)
    assert results[1].logprobs is not None and len(results[1].logprobs) == 4
    assert calls["logits"] >= 4 and calls["greedy_tokens"] >= 8
    assert_all_free(engine)


# (params, tokens so far, EOS id) -> whether sampling is the plain argmax this step.
PREDICATE_CASES = [
    (SamplingParams(temperature=0.0), [], 0, True),
    (SamplingParams(temperature=0.0, min_tokens=3), [5], 0, False),  # EOS banned this step
    (SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), [5], 0, True),
    (SamplingParams(temperature=0.0, min_tokens=3), [5, 6, 7], 0, True),  # reached
    (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(0,)), [], None, False),
    (SamplingParams(temperature=0.0, min_tokens=3), [], None, True),  # nothing to ban
    (SamplingParams(temperature=0.0, logit_bias=((3, 5.0),)), [], 0, False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.3), [], 0, False),
    (SamplingParams(temperature=0.0, logprobs=0), [], 0, False),
    (SamplingParams(temperature=0.0, bad_words_token_ids=((0,),)), [], 0, False),
    (SamplingParams(temperature=0.7, seed=1), [], 0, False),
]


@pytest.mark.parametrize("params,output,eos,plain", PREDICATE_CASES)
def test_greedy_only_lets_through_only_the_plain_argmax(params, output, eos, plain):
    """Sampler.greedy_only against Sampler itself: where it says yes, sampling returns the argmax
    and no logprobs, on logits whose best token is the EOS / stop / banned token 0."""
    assert Sampler.greedy_only([params], [output], [eos]) is plain
    assert Sampler.greedy_only([SamplingParams(temperature=0.0), params], [[], output], [0, eos]) is plain
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    logits[:, 0] += 10.0
    out = Sampler()(logits, [f"r{i}" for i in range(6)], [params] * 6, [list(output)] * 6, [[1, 2]] * 6, [eos] * 6)
    if plain:
        assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 6
