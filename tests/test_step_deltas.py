"""Step deltas (core/step_types.py): the runner's own copy of each sample, kept from the deltas,
must equal the scheduler's and the KV cache manager's truth after every step.

The oracle is the state the deltas replace: the manager's block tables per layer group (null
placeholders behind a sliding window included) and the sample's output tokens. Exercised where the
tables change other than by appending: preemption (the sample comes back as new), prefix-cache hits
and samples 2..n starting from shared blocks, and sliding-window groups freeing blocks. The tokens
themselves are checked against transformers elsewhere (test_engine_vs_transformers.py,
test_sliding_window_kv.py, test_prefix_caching.py); this checks the runner computes on the same
tables and history the scheduler holds.
"""

from __future__ import annotations

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams


def assert_runner_mirrors_scheduler(engine: LLMEngine) -> None:
    kv, batch = engine.kv_cache_manager, engine.runner.batch
    for sample in engine.scheduler.running:
        held = batch.samples.get(sample.seq_id)
        assert held is not None, f"sample {sample.seq_id} runs but the runner does not hold it"
        for group, ids in enumerate(kv.get_group_block_ids(sample)):
            assert batch.block_tables.row_ids(held.row, group) == ids, f"sample {sample.seq_id}, group {group}"
        assert held.output_token_ids == sample.output_token_ids
        assert held.static.prompt_token_ids == sample.prompt_token_ids
        assert held.static.sampling_params == sample.sampling_params
    for sample in engine.scheduler.waiting:  # preempted or never admitted: the runner holds nothing
        assert sample.seq_id not in batch.samples or sample.seq_id in engine.scheduler._finished_since_last_step


def run_checked(engine: LLMEngine, prompts, params) -> dict[str, list[list[int]]]:
    ids = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    tokens = {i: [[] for _ in range(sp.n)] for i, sp in zip(ids, params)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id][out.index].extend(out.new_token_ids)
        assert_runner_mirrors_scheduler(engine)
    engine.step()  # reports the last finished samples: the runner drops them
    assert not engine.runner.batch.samples
    return tokens


def make_engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", "block_size": 4,
                                             "max_num_batched_tokens": 24, **overrides}))


def mixed_params() -> list[SamplingParams]:
    """Penalties, min_tokens and bad words read the runner's history; n > 1 forks samples."""
    return [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=26, repetition_penalty=1.3, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=28, presence_penalty=0.7, frequency_penalty=0.4,
                           min_tokens=20),
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words_token_ids=((5, 6),))]


def test_runner_state_follows_preemption_n_samples_and_prefix_hits(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), num_kv_blocks=40, max_num_seqs=8)
    shared = list(range(10, 30))  # 5 full blocks every prompt starts with
    prompts = [shared + [40 + i] * (3 + i) for i in range(4)]
    tokens = run_checked(engine, prompts, mixed_params())
    assert engine.stats.num_preemptions_total > 0, "the pool was meant to be too small for all at once"
    assert engine.stats.prefix_cache_hits_total > 0
    # Preempted, recomputed or not, the run equals one without any pressure on the pool.
    roomy = make_engine(tiny_model_dir("llama"), num_kv_blocks=400, max_num_seqs=8)
    assert run_checked(roomy, prompts, mixed_params()) == tokens
    assert roomy.stats.num_preemptions_total == 0


def test_runner_state_follows_sliding_window_groups(tiny_model_dir):
    engine = make_engine(tiny_model_dir("gemma3-groups"), num_kv_blocks=40, max_num_seqs=6, block_size=8,
                         max_num_batched_tokens=32)
    assert engine.kv_cache_manager.num_groups > 1 and engine.kv_cache_manager.null_block is not None
    null = engine.kv_cache_manager.null_block.block_id
    saw_null = []
    real_step = engine.step

    def step():
        outputs = real_step()
        batch = engine.runner.batch
        saw_null.append(any(null in batch.block_tables.row_ids(s.row, g)
                            for s in batch.samples.values() for g in range(batch.num_groups)))
        return outputs

    engine.step = step
    prompts = [[3 + (7 * i + j) % 300 for j in range(40 + 9 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=1 + i % 2) for i in range(5)]
    tokens = run_checked(engine, prompts, params)
    assert any(saw_null), "no sliding group freed blocks behind its window"
    assert engine.stats.num_preemptions_total > 0
    roomy = make_engine(tiny_model_dir("gemma3-groups"), num_kv_blocks=600, max_num_seqs=6, block_size=8,
                        max_num_batched_tokens=32)
    assert run_checked(roomy, prompts, params) == tokens
