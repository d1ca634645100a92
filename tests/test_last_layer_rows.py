"""The last layer takes only the logits rows (ForwardBatch.sampled, LlamaDecoder.final_hidden): in
a step with a prefill chunk, the rows no logits are taken from leave their K and V in the cache at
the last layer and go no further; the sampled rows attend there as decode rows. The tokens must
stay transformers' greedy tokens (the oracle) for every family (sliding windows, softcaps, Gemma's
norms); the same batch computed whole must give the same K/V and the same hidden rows up to the
attention kernels' rounding; and the runner must only prune where every logits row is its
request's last row (no prompt logprobs) and some row is not one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.core.model_runner import ModelRunner
from pagedserve.core.models.llama import LlamaDecoder
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy
from tests.test_architectures import make_engine
from tests.test_engine_vs_transformers import assert_all_free, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def batches(monkeypatch):
    """Every ForwardBatch the runner prepares, in order."""
    seen = []
    original = ModelRunner.prepare

    def recorded(self, *args):
        batch = original(self, *args)
        seen.append(batch)
        return batch

    monkeypatch.setattr(ModelRunner, "prepare", recorded)
    return seen


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma2", "phi3"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_tokens_stay_transformers_with_the_last_layer_pruned(tiny_model_dir, batches, family, backend):
    """Staggered prompts under a small token budget: steps mix final prefill chunks, chunks that do
    not sample yet and decode rows."""
    path = tiny_model_dir(family)
    engine = make_engine(path, family, attention_backend=backend, max_num_batched_tokens=40)
    prompts = random_prompts(5, 3, 70, seed=21)
    results = engine.generate(prompts, GREEDY)
    for prompt, res in zip(prompts, results):
        assert list(res.token_ids) == hf_greedy(path, prompt, GREEDY.max_tokens)
    assert any(b.sampled is not None for b in batches)
    assert_all_free(engine)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pruned_step_equals_the_whole_step(tiny_model_dir, batches, monkeypatch, family):
    """Each pruned step is computed again whole on a copy of the caches as they were before it:
    the caches afterwards are equal bit for bit (every row's K / V is written either way) and the
    logits rows' hidden states agree to fp32 rounding (the last layer's sampled rows attend through
    the decode kernel instead of the prefill kernel)."""
    engine = make_engine(tiny_model_dir(family), family, attention_backend="cpu", max_num_batched_tokens=40)
    original = LlamaDecoder.final_hidden
    compared = []

    def both(self, batch, kv_caches):
        if batch.sampled is None:
            return original(self, batch, kv_caches)
        before = [[t.clone() for t in (kv.key_cache, kv.value_cache)] for kv in kv_caches]
        pruned = original(self, batch, kv_caches)
        after = [[t.clone() for t in (kv.key_cache, kv.value_cache)] for kv in kv_caches]
        for kv, (k, v) in zip(kv_caches, before):
            kv.key_cache.copy_(k)
            kv.value_cache.copy_(v)
        whole = original(self, dataclasses.replace(batch, sampled=None), kv_caches)
        for kv, (k, v) in zip(kv_caches, after):
            assert torch.equal(kv.key_cache, k) and torch.equal(kv.value_cache, v)
        assert pruned.shape == whole.shape == (batch.logits_indices.numel(), whole.shape[1])
        torch.testing.assert_close(pruned, whole, rtol=1e-5, atol=1e-5)
        compared.append(batch.num_tokens - pruned.shape[0])
        return pruned

    monkeypatch.setattr(LlamaDecoder, "final_hidden", both)
    engine.generate(random_prompts(4, 20, 60, seed=22), GREEDY)
    assert compared and max(compared) > 10  # steps where many rows were skipped


def test_the_runner_prunes_only_where_every_logits_row_is_a_last_row(tiny_model_dir, batches):
    """Not in pure decode steps (nothing to skip), not in steps where no row samples, not while a
    request scores its prompt (prompt_logprobs: all its rows are logits rows); else each pruned
    request is a sampled one, with its own block table row and length."""
    engine = make_engine(tiny_model_dir("llama"), "llama", attention_backend="cpu", max_num_batched_tokens=32)
    prompts = random_prompts(3, 40, 60, seed=23)
    scoring = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    engine.generate(prompts[:1], scoring)
    assert batches and all(b.sampled is None for b in batches)
    batches.clear()
    engine.generate(prompts, GREEDY)
    for b in batches:
        q_lens = (b.query_start_loc[1:] - b.query_start_loc[:-1]).tolist()
        sampling = len(b.logits_indices)
        if all(q == 1 for q in q_lens) or sampling == 0:
            assert b.sampled is None
            continue
        assert b.sampled is not None
        seqs = [s for s in range(len(q_lens)) if b.query_start_loc[s + 1] - 1 in b.logits_indices.tolist()]
        assert len(seqs) == sampling
        assert torch.equal(b.sampled.block_tables[0], b.block_table[seqs])
        assert torch.equal(b.sampled.seq_lens, b.seq_lens[seqs])
        assert b.sampled.max_seq_len == int(b.seq_lens[seqs].max())
        assert b.sampled.query_start_loc.tolist() == list(range(sampling + 1))
    assert any(b.sampled is not None for b in batches)
    assert_all_free(engine)
