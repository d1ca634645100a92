"""Sampler: each stage against an independent oracle (hand-computed masks, transformers' logits
processors, the OpenAI penalty formula in numpy, a chi-square test against the intended distribution)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from pagedserve.core.sampler import (
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs,
)
from pagedserve.core.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
# Chi-square critical values at alpha = 0.001 by degrees of freedom (standard tables).
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def run(sampler, logits, params, outputs=None, prompts=None, eos=None, ids=None) -> SamplerOutput:
    n = logits.shape[0]
    params = params if isinstance(params, list) else [params] * n
    return sampler(logits, ids or [f"r{i}" for i in range(n)], params, outputs or [[] for _ in range(n)],
                   prompts or [[] for _ in range(n)], eos if eos is not None else [None] * n)


def survivors(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    assert expected.min() >= 5, "chi-square needs >= 5 expected per cell"
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------- greedy, API


def test_greedy_is_argmax_and_no_logprobs_unless_asked():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = run(Sampler(), logits, GREEDY)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8
    # mixed with random rows, greedy rows are untouched
    params = [GREEDY if i % 2 else SamplingParams(temperature=1.5, seed=i) for i in range(8)]
    out = run(Sampler(), logits, params)
    assert out.token_ids[1::2] == logits.argmax(-1).tolist()[1::2]


def test_old_call_pattern_and_mismatched_lists_fail_loudly():
    logits = torch.zeros(2, 10)
    with pytest.raises(TypeError):
        Sampler()(logits, ["a", "b"], [GREEDY, GREEDY])  # the pre-#3 signature
    with pytest.raises(ValueError, match="2 logits rows"):
        Sampler()(logits, ["a", "b"], [GREEDY, GREEDY], [[]], [[], []], [None, None])


def test_input_logits_are_not_modified():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.5,
                            frequency_penalty=1.0, min_tokens=4, stop_token_ids=(3,), logprobs=2)
    run(Sampler(), logits, params, outputs=[[1, 2]] * 3, prompts=[[4, 5]] * 3, eos=[0] * 3)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- masks


def test_top_k_top_p_min_p_masks_by_hand():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = p.log().repeat(8, 1)
    # (top_k, top_p) -> survivors, worked out by hand from p
    cases = [
        (2, 1.0, {0, 1}),
        (0, 1.0, {0, 1, 2, 3}),
        (100, 1.0, {0, 1, 2, 3}),       # k beyond the vocabulary: off
        (0, 0.1, {0}),                  # the top token is always kept
        (0, 0.6, {0, 1}),               # mass above token 1 is 0.5 < 0.6, above token 2 is 0.75
        (0, 0.8, {0, 1, 2}),
        (3, 0.95, {0, 1, 2}),           # top-p on the top-k renormalised [.5,.25,.15]/.9: above token 2 .83
        (2, 0.6, {0}),                  # renormalised [2/3, 1/3]: 2/3 >= 0.6 already
    ]
    masked = apply_top_k_top_p(logits, [c[0] for c in cases], [c[1] for c in cases])
    for row, (_, _, want) in zip(masked, cases):
        assert survivors(row) == want
        assert torch.equal(row[list(want)], logits[0, list(want)])  # survivors keep their logits
    # ties with the k-th logit are kept (as transformers' TopKLogitsWarper)
    tied = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert survivors(apply_top_k_top_p(tied, [2], [1.0])[0]) == {0, 1, 2}
    # min_p is relative to the most likely token: threshold = min_p * 0.5
    min_p_cases = [(0.0, {0, 1, 2, 3}), (0.1, {0, 1, 2, 3}), (0.4, {0, 1}), (0.6, {0}), (1.0, {0})]
    masked = apply_min_p(logits[:5], [c[0] for c in min_p_cases])
    for row, (_, want) in zip(masked, min_p_cases):
        assert survivors(row) == want


def test_masks_match_transformers_warpers():
    gen = torch.Generator().manual_seed(2)
    settings = [(k, p, m) for k in (0, 1, 5, 20) for p in (1.0, 0.9, 0.5) for m in (0.0, 0.05, 0.3)]
    logits = torch.randn(len(settings), 64, generator=gen) * 2
    ours = apply_min_p(apply_top_k_top_p(logits, [s[0] for s in settings], [s[1] for s in settings]),
                       [s[2] for s in settings])
    for row, (k, p, m) in enumerate(settings):
        ref = logits[row : row + 1].clone()
        warpers = ([TopKLogitsWarper(k)] if k else []) + [TopPLogitsWarper(p)] + ([MinPLogitsWarper(m)] if m else [])
        for w in warpers:
            ref = w(None, ref)
        assert survivors(ours[row]) == survivors(ref[0]), (k, p, m)


def test_top_k_top_p_shortcut_and_fallback_match_transformers():
    """apply_top_k_top_p looks for the kept tokens among the top `width` (topk) and falls back to a
    full sort when they may lie beyond; both paths, alone and batched, against transformers."""
    gen = torch.Generator().manual_seed(8)
    vocab = 3000
    peaked, flat = torch.randn(vocab, generator=gen) * 3, torch.randn(vocab, generator=gen) * 0.1
    tied = peaked.clone()
    top2 = tied.topk(2).indices
    tied[tied.topk(3).indices[2]] = tied[top2[1]]  # the 3rd logit ties with the 2nd
    cases = [  # (logits, top_k, top_p)
        (peaked, 50, 1.0), (peaked, 50, 0.9), (peaked, 0, 0.9), (peaked, 0, 0.5),
        (flat, 0, 0.99),     # nucleus of ~2900 tokens: beyond the 1024 candidates -> full sort
        (flat, 2000, 0.95),  # top-k beyond the p-only guess
        (tied, 2, 1.0), (tied, 2, 0.999),  # a tie at the k-th logit forces the fallback; kept
    ]
    batch = torch.stack([c[0] for c in cases])
    together = apply_top_k_top_p(batch, [c[1] for c in cases], [c[2] for c in cases])
    for i, (row, k, p) in enumerate(cases):
        ref = row[None].clone()
        for w in ([TopKLogitsWarper(k)] if k else []) + [TopPLogitsWarper(p)]:
            ref = w(None, ref)
        alone = apply_top_k_top_p(row[None], [k], [p])
        assert torch.equal(alone, ref), (k, p)
        assert torch.equal(together[i : i + 1], ref), (k, p)
    assert len(survivors(together[4])) > 1024 and len(survivors(together[6])) == 3


# ---------------------------------------------------------------- penalties, min_tokens


def test_repetition_penalty_matches_transformers():
    gen = torch.Generator().manual_seed(3)
    vocab = 40
    logits = torch.randn(3, vocab, generator=gen) * 3  # both signs
    prompts = [[1, 2, 3, 3, 39], [0, 5], []]
    outputs = [[7, 7, 2], [], [9, 10, 11]]
    penalties = [1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    ours = apply_penalties(logits, params, outputs, prompts)
    for i, r in enumerate(penalties):
        input_ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(r)(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref, rtol=1.3e-6, atol=1e-6)
    # through the Sampler: greedy picks the argmax of the penalised logits
    out = run(Sampler(), logits, [SamplingParams(temperature=0, repetition_penalty=r) for r in penalties],
              outputs=outputs, prompts=prompts)
    assert out.token_ids == ours.argmax(-1).tolist()


def test_presence_and_frequency_penalties_match_openai_formula():
    rng = np.random.default_rng(4)
    vocab = 30
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    outputs = [[1, 1, 1, 4, 9], [2], []]
    prompts = [[3, 3, 5], [6], [1, 2]]  # prompt tokens are not penalised by these two
    settings = [(0.5, 0.3), (-1.0, 2.0), (2.0, -2.0)]
    params = [SamplingParams(presence_penalty=pr, frequency_penalty=fr) for pr, fr in settings]
    ours = apply_penalties(torch.from_numpy(logits), params, outputs, prompts).numpy()
    for i, (presence, frequency) in enumerate(settings):
        # https://platform.openai.com/docs/advanced-usage: mu[j] - c[j] * alpha_freq - (c[j] > 0) * alpha_presence
        counts = np.zeros(vocab)
        for tok, c in Counter(outputs[i]).items():
            counts[tok] = c
        expected = logits[i].astype(np.float64) - counts * frequency - (counts > 0) * presence
        np.testing.assert_allclose(ours[i], expected, rtol=0, atol=1e-5)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    vocab = 10
    logits = torch.arange(vocab, dtype=torch.float32).flip(0).repeat(4, 1)  # token 0 best, then 1, 2...
    eos = [0, 0, 0, None]
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(1, 99)),  # 99: beyond the vocab
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(1,)),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(1,), ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(0,)),  # no EOS, a stop id
    ]
    outputs = [[5, 5], [5, 5, 5], [5], []]
    out = run(Sampler(), logits, params, outputs=outputs, eos=eos)
    # row 0: 2 < 3 tokens: EOS 0 and stop 1 banned; row 1: reached; row 2: EOS allowed (ignore_eos);
    # row 3: stop id 0 banned
    assert out.token_ids == [2, 0, 0, 1]
    # random sampling never draws a banned token either
    flat = torch.zeros(2000, vocab)
    out = run(Sampler(), flat, SamplingParams(min_tokens=1, stop_token_ids=(3,)), eos=[5] * 2000)
    assert set(out.token_ids) == set(range(vocab)) - {3, 5}


# ---------------------------------------------------------------- seeds and distributions


def _sequence(sampler, logits_steps, rid, others, position):
    """Tokens of request `rid` over the steps, sharing each step's batch with `others` at `position`."""
    tokens = []
    for step_logits in logits_steps:
        rows = list(others)
        rows.insert(position, (rid, SamplingParams(temperature=1.0, top_k=30, seed=1234)))
        batch = torch.randn(len(rows), step_logits.shape[1])  # the other rows' logits must not matter
        batch[position] = step_logits[0]
        out = run(sampler, batch, [p for _, p in rows], ids=[r for r, _ in rows])
        tokens.append(out.token_ids[position])
    return tokens


def test_seeded_tokens_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(1, 100, generator=gen) for _ in range(12)]
    alone = _sequence(Sampler(), steps, "a", [], 0)
    others = [("b", SamplingParams(temperature=0.7)), ("c", GREEDY), ("d", SamplingParams(seed=1234, top_p=0.5)),
              ("e", SamplingParams(temperature=2.0, seed=9, repetition_penalty=1.2))]
    assert _sequence(Sampler(), steps, "a", others, 0) == alone
    assert _sequence(Sampler(), steps, "a", others[::-1], 3) == alone
    assert len(set(alone)) > 1  # the generator advances between steps

    def seq(seed):
        sampler = Sampler()
        return [run(sampler, s, SamplingParams(seed=seed), ids=["x"]).token_ids[0] for s in steps]

    assert seq(1) == seq(1) and seq(1) != seq(2)
    sampler = Sampler()
    first = [run(sampler, s, SamplingParams(seed=3), ids=["x"]).token_ids[0] for s in steps]
    sampler.forget(["x"])  # a finished request's generator is dropped; the id starts afresh
    assert [run(sampler, s, SamplingParams(seed=3), ids=["x"]).token_ids[0] for s in steps] == first


P = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
DIST_CASES = [
    # (params, intended distribution worked out by hand from P)
    (dict(temperature=1.0), P),
    (dict(temperature=0.5), P**2 / (P**2).sum()),
    (dict(temperature=2.0), np.sqrt(P) / np.sqrt(P).sum()),
    (dict(top_k=3), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85),
    (dict(top_p=0.75), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85),  # mass above token 3 is 0.85
    (dict(top_k=2, temperature=0.5), np.array([0.16, 0.09, 0, 0, 0]) / 0.25),
    (dict(min_p=0.3), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85),  # threshold 0.12
]


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("kwargs,probs", DIST_CASES, ids=[str(k) for k, _ in DIST_CASES])
def test_sample_distribution_chi_square(kwargs, probs, seeded):
    n = 4000 if seeded else 20000
    logits = torch.from_numpy(np.log(P)).float().repeat(n, 1)
    params = [SamplingParams(seed=1000 + i, **kwargs) for i in range(n)] if seeded else [SamplingParams(**kwargs)] * n
    counts = np.bincount(run(Sampler(), logits, params).token_ids, minlength=len(P))
    assert (counts[probs == 0] == 0).all(), counts  # masked tokens are never drawn
    keep = probs > 0
    stat = chi_square(counts[keep], probs[keep])
    assert stat < CHI2_CRIT_001[int(keep.sum()) - 1], (stat, counts, probs)


def test_one_seeded_request_over_many_steps_follows_the_distribution():
    sampler = Sampler()
    logits = torch.from_numpy(np.log(P)).float()[None]
    tokens = [run(sampler, logits, SamplingParams(seed=77), ids=["s"]).token_ids[0] for _ in range(2000)]
    stat = chi_square(np.bincount(tokens, minlength=len(P)), P)
    assert stat < CHI2_CRIT_001[len(P) - 1], stat


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_distribution():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 30, generator=gen) * 2
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0),  # did not ask
        SamplingParams(temperature=5.0, seed=1, logprobs=3, repetition_penalty=2.0, presence_penalty=1.0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=100.0, seed=4, logprobs=20, top_k=0),
    ]
    out = run(Sampler(), logits, params, outputs=[[1, 2]] * 5, prompts=[[3]] * 5)
    assert out.logprobs[1] is None
    x = logits.double().numpy()
    ref = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    for i in (0, 2, 3, 4):
        lp, tok = out.logprobs[i], out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == torch.log_softmax(logits[i], -1)[tok].item()  # exact: same op on the raw row
        assert abs(lp.logprob - ref[i, tok]) < 1e-5
        assert lp.rank == 1 + int((x[i] > x[i, tok]).sum())
        want = np.argsort(-x[i], kind="stable")[: params[i].logprobs]
        assert [t for t, _ in lp.top] == want.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], ref[i, want], rtol=0, atol=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert out.logprobs[0].rank == 1 and out.logprobs[3].top == ()
    assert max(out.logprobs[i].rank for i in (2, 4)) > 1  # hot sampling drew a non-argmax token


def test_bfloat16_logits():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = run(Sampler(), logits, SamplingParams(temperature=0, logprobs=2))
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert all(math.isfinite(lp.logprob) and lp.rank == 1 for lp in out.logprobs)


def test_compute_logprobs_for_given_targets():
    """The prompt-logprobs entry point: any target token, a per-row N (0 allowed)."""
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(9))
    targets, num_top = [5, 0, 11], [0, 3, 12]
    found = compute_logprobs(logits, targets, num_top)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, lp in enumerate(found):
        assert lp.token_id == targets[i] and abs(lp.logprob - ref[i, targets[i]].item()) < 1e-5
        assert lp.rank == 1 + int((logits[i] > logits[i, targets[i]]).sum())
        assert [t for t, _ in lp.top] == torch.argsort(logits[i], descending=True)[: num_top[i]].tolist()
    assert compute_logprobs(logits[:0], [], []) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_tokens_and_logprobs_on_cuda_as_on_cpu():
    """Seeded noise comes from CPU generators, so a seeded request draws the same tokens on any device."""
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(10)) * 2
    params = [SamplingParams(temperature=0.9, seed=s, top_k=k, top_p=p, min_p=m, repetition_penalty=1.2,
                             frequency_penalty=0.3, presence_penalty=0.2, min_tokens=9, stop_token_ids=(7,), logprobs=3)
              for s, k, p, m in [(1, 0, 1.0, 0.0), (2, 40, 0.9, 0.0), (3, 0, 0.8, 0.0), (4, 0, 1.0, 0.05),
                                 (5, 100, 0.95, 0.02), (6, 0, 1.0, 0.0)]]
    outputs, prompts = [[7, 8, 8, 9]] * 6, [list(range(100))] * 6
    cpu, gpu = Sampler(), Sampler()
    for _ in range(5):
        a = run(cpu, logits, params, outputs=outputs, prompts=prompts, eos=[0] * 6)
        b = run(gpu, logits.cuda(), params, outputs=outputs, prompts=prompts, eos=[0] * 6)
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.rank == y.rank and abs(x.logprob - y.logprob) < 1e-4
