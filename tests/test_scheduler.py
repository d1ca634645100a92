"""Scheduler without a model: token budget, chunked prefill beside decodes, admission, preemption."""

from __future__ import annotations

from pagedserve.core.config import SchedulerConfig
from pagedserve.core.request import Sample, SampleStatus
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.core.scheduler import Scheduler


def make(num_blocks=64, block_size=4, budget=16, max_num_seqs=8, max_model_len=1000) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), max_model_len,
                     num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 8) -> Sample:
    r = Sample(request_id=rid, prompt_token_ids=[7] * prompt_len, sampling_params=SamplingParams(ignore_eos=True),
                eos_token_id=0, max_tokens=max_tokens)
    s.add_sample(r)
    return r


def step(s: Scheduler, token: int = 5):
    out = s.schedule()
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    s.update_from_output(out, {r.seq_id: token for r in out.requests if r.sample})
    s.kv.check_invariants()
    return out


def test_long_prompt_is_chunked_beside_running_decodes():
    s = make(budget=16)
    short = add(s, "short", 3, max_tokens=20)
    step(s)  # prefill of "short", samples its first token
    long = add(s, "long", 40)
    chunks = []
    for _ in range(4):
        out = step(s)
        by_id = {r.seq_id: r for r in out.requests}
        assert len(by_id[short.seq_id].token_ids) == 1 and by_id[short.seq_id].sample  # decode never stalls
        chunks.append(len(by_id[long.seq_id].token_ids))
    assert chunks[:2] == [15, 15]  # budget 16 minus the decode
    assert sum(chunks[:3]) == 40 and chunks[2] == 10
    assert [r.sample for r in out.requests if r.seq_id == long.seq_id] == [True]  # 4th step: long decodes


def test_positions_and_tokens_cover_the_prompt_exactly_once():
    s = make(budget=7)
    r = add(s, "a", 20, max_tokens=3)
    starts = []
    while s.has_unfinished_requests():
        out = step(s)
        starts.extend((x.start_position, len(x.token_ids)) for x in out.requests)
    assert starts[:3] == [(0, 7), (7, 7), (14, 6)]
    assert [p for p, _ in starts[3:]] == [20, 21]
    assert r.status == SampleStatus.FINISHED_LENGTH and r.output_token_ids == [5, 5, 5]


def test_max_num_seqs_limits_admission():
    s = make(budget=100, max_num_seqs=3)
    for i in range(5):
        add(s, f"r{i}", 4)
    out = step(s)
    assert len(out.requests) == 3 and s.stats.num_waiting == 2


def test_preemption_takes_the_most_recently_admitted_and_recomputes():
    s = make(num_blocks=6, block_size=4, budget=64)
    a = add(s, "a", 8, max_tokens=8)   # 2 blocks, grows to 4
    b = add(s, "b", 8, max_tokens=8)   # 2 blocks
    step(s)
    assert s.stats.num_running == 2 and s.kv.num_free_blocks == 2
    for _ in range(8):
        out = step(s)
        if out.preempted_seq_ids:
            break
    assert out.preempted_seq_ids == (b.seq_id,)
    assert b.status == SampleStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and s.stats.num_preemptions_total == 1
    while s.has_unfinished_requests():
        out = step(s)
        for x in out.requests:
            if x.seq_id == b.seq_id and x.start_position == 0:
                # resumed: recomputes prompt + the tokens it had generated, keeps its output
                assert len(x.token_ids) == b.num_prompt_tokens + len(x.output_token_ids)
    assert a.output_token_ids == [5] * 8 and b.output_token_ids == [5] * 8
    assert s.kv.num_free_blocks == 6


def test_abort_waiting_and_running():
    s = make()
    run = add(s, "run", 4)
    step(s)
    wait = add(s, "wait", 4)
    aborted = SampleStatus.FINISHED_ABORTED
    assert s.finish_sample(wait, aborted) and wait.status.finish_reason == "abort"
    assert s.finish_sample(run, aborted) and run.status.finished
    assert not s.finish_sample(run, SampleStatus.FINISHED_STOPPED)  # already finished: nothing changes
    assert run.status == aborted
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 64
    assert set(s.schedule().finished_seq_ids) == {run.seq_id, wait.seq_id}


def test_stop_token_ids_and_min_tokens():
    s = make()
    r = Sample(request_id="x", prompt_token_ids=[1, 2], eos_token_id=9, max_tokens=10,
                sampling_params=SamplingParams(min_tokens=2, stop_token_ids=(4,)))
    s.add_sample(r)
    step(s, token=9)  # EOS before min_tokens: ignored
    assert r.status == SampleStatus.RUNNING
    step(s, token=4)  # stop token once min_tokens reached
    assert r.status == SampleStatus.FINISHED_STOPPED and r.output_token_ids == [9, 4]
