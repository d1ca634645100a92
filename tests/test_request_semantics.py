"""Request semantics end to end: n > 1 sharing the prompt, logprobs against transformers,
seeded sampling independent of batch and chunking, stop strings and stop tokens."""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import InvalidRequest, RequestTooLong
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy, hf_model


def make_engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", **overrides}))


def rand_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logprobs(path, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ids: [len(ids), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(path)(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_n_samples_share_prompt_blocks_and_prefill_once(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=16)
    prompt = rand_prompt(37, seed=1)
    engine.add_request("multi", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))
    shared_seen = False
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
        samples = [r for r in engine.scheduler.samples.values() if r.request_id == "multi"]
        tables = [engine.kv_cache_manager.get_block_ids(r) for r in samples]
        live = [t for t in tables if t]
        if len(live) == 4:
            common = set.intersection(*(set(t[:9]) for t in live))
            shared_seen |= len(common) == 9  # the 9 full prompt blocks (36 tokens) are shared
        engine.kv_cache_manager.check_invariants()
    assert shared_seen
    # 37 prompt tokens computed once by the leader, plus the last prompt token by each other sample
    assert engine.stats.num_computed_prompt_tokens_total == 37 + 3
    samples = {i: [t for o in outs if o.index == i for t in o.new_token_ids] for i in range(4)}
    assert all(len(s) == 6 for s in samples.values())
    assert len({tuple(s) for s in samples.values()}) > 1  # different seeds per sample
    assert {o.request_id for o in outs} == {"multi"}
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_n_greedy_samples_all_equal_transformers(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    engine = make_engine(path, block_size=16)
    prompt = rand_prompt(40, seed=2)
    res = engine.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True))
    expected = hf_greedy(path, prompt, 10)
    assert [r.index for r in res] == [0, 1, 2]
    assert all(list(r.token_ids) == expected for r in res)


def test_seeded_sampling_ignores_batch_and_chunking(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt = rand_prompt(50, seed=3)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = make_engine(path, max_num_batched_tokens=1024).generate([prompt], params)[0].token_ids
    others = [rand_prompt(30 + i, seed=10 + i) for i in range(5)]
    mixed = make_engine(path, max_num_batched_tokens=13, block_size=4).generate(
        others[:3] + [prompt] + others[3:], [SamplingParams(temperature=1.0, max_tokens=20)] * 3 + [params]
        + [SamplingParams(temperature=1.0, max_tokens=20)] * 2)[3].token_ids
    assert alone == mixed


def test_logprobs_match_transformers(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    engine = make_engine(path, max_num_batched_tokens=7)  # chunked prompt
    prompt = rand_prompt(20, seed=4)
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                   logprobs=3, prompt_logprobs=2))[0]
    ref = hf_logprobs(path, prompt + list(res.token_ids))
    tol = 1e-4  # fp32 engine vs fp32 transformers: same math, different op order
    assert len(res.logprobs) == 8
    for j, lp in enumerate(res.logprobs):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_id == res.token_ids[j] and lp.rank == 1
        assert abs(lp.logprob - row[lp.token_id].item()) < tol
        top_ids = row.topk(3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert all(abs(v - row[t].item()) < tol for t, v in lp.top)
    assert res.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in res.logprobs), abs=1e-5)
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = res.prompt_logprobs[p]
        assert entry.token_id == prompt[p]
        assert abs(entry.logprob - ref[p - 1][prompt[p]].item()) < tol
        assert len(entry.top) == 2


def test_stop_token_ids_and_max_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path)
    prompt = rand_prompt(12, seed=5)
    expected = hf_greedy(path, prompt, 20)
    stop_tok = expected[5]
    first = expected.index(stop_tok)
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok],
                                                   ignore_eos=True))[0]
    assert list(res.token_ids) == expected[: first + 1]
    assert res.finish_reason == "stop" and res.stop_reason == stop_tok


def test_stop_string_finishes_and_truncates(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path)
    prompt = rand_prompt(12, seed=6)
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 10
    stop = text[6:9]
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == text[: text.index(stop)]
    assert len(res.token_ids) < 30
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_a_stop_string_ends_the_sample_through_the_scheduler_in_the_same_step(tiny_model_dir):
    """The output stage reports the stop string; the sample is finished (blocks freed, request
    gone) in the step whose output says so, and "stop" wins where the same token hits max_tokens."""
    path = tiny_model_dir("llama")
    engine = make_engine(path)
    prompt = rand_prompt(12, seed=6)
    text = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].text
    stop = text[6:9]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    engine.add_request("s", prompt, params)
    (sample,) = engine.scheduler.samples.values()
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
        if final is None:
            assert engine.kv_cache_manager.num_used_blocks > 0
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert sample.status.finish_reason == "stop" and sample.stop_reason == stop
    assert engine.kv_cache_manager.num_used_blocks == 0 and not engine.is_live("s")
    # the token that completes the stop string is also the last one max_tokens allows
    last = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=final.num_output_tokens,
                                                    ignore_eos=True, stop=[stop]))[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert last.text == text[: text.index(stop)]


def test_no_per_sample_state_outlives_its_request(tiny_model_dir):
    """Finished, stopped, aborted and timed-out samples leave nothing behind in any component."""
    path = tiny_model_dir("llama")
    engine = make_engine(path, block_size=4)
    prompt = rand_prompt(20, seed=8)
    seeded = SamplingParams(n=3, temperature=1.0, seed=3, repetition_penalty=1.2, max_tokens=6, ignore_eos=True)
    engine.add_request("n3", prompt, seeded)
    engine.add_request("aborted", prompt, seeded)
    engine.add_request("timed-out", prompt, SamplingParams(max_tokens=50, ignore_eos=True), deadline=0.0)
    outputs = engine.step() + engine.step()
    assert engine.runner.sampler._cache  # seeded generators and cached prompts exist meanwhile
    outputs += engine.abort_request("aborted")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = {(o.request_id, o.index): o.finish_reason for o in outputs if o.finished}
    assert finals == {("n3", 0): "length", ("n3", 1): "length", ("n3", 2): "length", ("timed-out", 0): "timeout",
                      ("aborted", 0): "abort", ("aborted", 1): "abort", ("aborted", 2): "abort"}
    engine.generate([prompt], SamplingParams(max_tokens=1))  # the next step tells the runner who finished
    assert not engine._requests and not engine.scheduler.samples
    assert not engine.kv_cache_manager._samples and not engine.runner.sampler._cache
    engine.kv_cache_manager.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("params,error,needle", [
    (dict(max_tokens=2000), RequestTooLong, "max_tokens"),
    (dict(max_tokens=1), RequestTooLong, "prompt has"),
])
def test_length_errors_are_typed(tiny_model_dir, params, error, needle):
    engine = make_engine(tiny_model_dir("llama"), max_model_len=64)
    prompt = [1] * (64 if params["max_tokens"] == 1 else 10)
    with pytest.raises(error, match=needle):
        engine.add_request("x", prompt, SamplingParams(**params))
    assert not engine.has_unfinished_requests()


def test_bad_prompts_are_rejected(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"))
    for prompt, needle in [([], "empty"), ([1, -3], "item 1"), ([1, 2.5], "item 1"), (b"bytes", "string or a list")]:
        with pytest.raises(InvalidRequest, match=needle):
            engine.add_request(None, prompt, SamplingParams())


def run_all(engine: LLMEngine) -> dict[tuple[str, int], list]:
    outs: dict[tuple[str, int], list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
    return outs


def cached_counts(outs: dict[tuple[str, int], list], request_id: str) -> set[int]:
    """The num_cached_tokens every output of the request reported (one value, or the test fails)."""
    return {o.num_cached_tokens for (rid, _), seq in outs.items() if rid == request_id for o in seq}


def test_each_output_reports_the_prompt_tokens_served_from_the_prefix_cache(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path, block_size=16, num_kv_blocks=64)
    p = rand_prompt(40, seed=20)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cases = [  # (prompt, params, expected cached tokens), run one after the other
        (p, greedy, 0),                                     # nothing cached yet
        (p, greedy, 32),                                    # (40 - 1) // 16 full blocks: the last token runs
        (p[:35] + rand_prompt(9, seed=21), greedy, 32),     # diverges inside the third block
        (p[:10], greedy, 0),                                # shorter than one block
        (p, SamplingParams(max_tokens=2, prompt_logprobs=1), 0),  # scoring runs every prompt position
    ]
    for i, (prompt, params, want) in enumerate(cases):
        engine.add_request(f"r{i}", prompt, params)
        assert cached_counts(run_all(engine), f"r{i}") == {want}, i
    # n = 3: the counts of sample 0 (the one the prompt is charged to) follow the same rule
    engine.add_request("multi", p, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3))
    outs = run_all(engine)
    assert {o.num_cached_tokens for o in outs[("multi", 0)]} == {32}
    off = make_engine(path, block_size=16, num_kv_blocks=64, enable_prefix_caching=False)
    for i in range(2):
        off.add_request(f"off{i}", p, greedy)
        assert cached_counts(run_all(off), f"off{i}") == {0}


def test_cached_tokens_are_counted_at_arrival_not_again_after_preemption(tiny_model_dir):
    """b is preempted and recomputed from its own cached prompt blocks: that recompute is the
    engine's business; the client's prompt was not cached when it arrived, so b reports 0."""
    path = tiny_model_dir("llama")
    engine = make_engine(path, block_size=4, num_kv_blocks=7, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", rand_prompt(9, seed=22), params)
    engine.add_request("b", rand_prompt(9, seed=23), params)
    outs = run_all(engine)
    assert engine.stats.num_preemptions_total >= 1
    assert engine.stats.prefix_cache_hits_total > 0, "the recompute must have hit the cache"
    assert cached_counts(outs, "a") == cached_counts(outs, "b") == {0}
