"""core/limits.py: the character bound, the waiting-queue bounds and deadlines, on their own."""

from __future__ import annotations

import pytest

from pagedserve.core.config import LimitsConfig
from pagedserve.core.errors import EngineOverloaded
from pagedserve.core.limits import COMPACT_EVERY, Deadlines, WaitingQueueGuard, max_prompt_chars
from pagedserve.core.metrics import EngineMetrics
from pagedserve.core.request import Sample, SampleStatus
from pagedserve.core.sampling_params import SamplingParams


def test_a_text_over_the_character_bound_never_fits(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    max_model_len = 64
    bound = max_prompt_chars(tokenizer, max_model_len)
    longest = max(tokenizer.get_vocab(), key=len)
    # The worst case for the bound: text made of the vocabulary's longest token, as written by
    # the tokenizer (byte-level BPE spells bytes as characters; decode gives the real text).
    piece = tokenizer.convert_tokens_to_string([longest])
    text = (piece * (bound // len(piece) + 1))[: bound + 1]
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= max_model_len
    # and the bound is not absurdly loose for ordinary text: well under 100 characters a token here
    assert bound <= max_model_len * 100


def test_queue_guard_counts_requests_and_tokens_and_admits_a_lone_request():
    metrics = EngineMetrics()
    guard = WaitingQueueGuard(LimitsConfig(max_waiting_requests=3, max_waiting_prompt_tokens=100), metrics)
    guard.check(num_waiting=2, num_waiting_tokens=60, num_prompt_tokens=40)  # exactly at the token bound
    guard.check(num_waiting=0, num_waiting_tokens=0, num_prompt_tokens=5000)  # alone: always admitted
    with pytest.raises(EngineOverloaded, match="max_waiting_requests=3"):
        guard.check(num_waiting=3, num_waiting_tokens=10, num_prompt_tokens=1)
    with pytest.raises(EngineOverloaded, match="max_waiting_prompt_tokens=100"):
        guard.check(num_waiting=1, num_waiting_tokens=60, num_prompt_tokens=41)
    assert metrics.snapshot().request_refused_total == {"waiting_requests": 1, "waiting_prompt_tokens": 1}
    WaitingQueueGuard(LimitsConfig(max_waiting_requests=None, max_waiting_prompt_tokens=None), metrics).check(
        10**6, 10**9, 10**6)  # unbounded


def _request(rid: str, deadline: float | None) -> Sample:
    return Sample(rid, (1, 2), SamplingParams(), eos_token_id=None, max_tokens=4, deadline=deadline)


def test_deadlines_pop_due_unfinished_requests_in_order_and_compact():
    deadlines = Deadlines()
    a, b, c, never = _request("a", 3.0), _request("b", 1.0), _request("c", 2.0), _request("n", None)
    for r in (a, b, c, never):
        deadlines.add(r)
    c.status = SampleStatus.FINISHED_STOPPED  # finished before its deadline: never reported
    assert deadlines.pop_expired(now=0.5) == []
    assert deadlines.pop_expired(now=2.5) == [b]
    assert deadlines.pop_expired(now=10.0) == [a]
    # Finished requests do not pile up in the heap while their deadlines are far away.
    for i in range(2 * COMPACT_EVERY):
        r = _request(f"x{i}", 1e9)
        deadlines.add(r)
        r.status = SampleStatus.FINISHED_LENGTH
    assert len(deadlines._heap) <= COMPACT_EVERY


def test_a_burst_into_free_slots_is_not_overload(tiny_model_dir):
    # The bound counts requests that must wait for a slot of the running batch: five requests
    # arriving between two steps fill four free slots and the one-place queue; the sixth would
    # wait beyond the bound and is refused (the engine has not stepped: nothing runs yet).
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32",
                                               "max_num_seqs": 4, "max_waiting_requests": 1}))
    for i in range(5):
        engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(EngineOverloaded, match="1 requests are already waiting"):
        engine.add_request("r5", [1, 2, 3], SamplingParams(max_tokens=2))
    engine.step()  # four run now, one waits
    with pytest.raises(EngineOverloaded):
        engine.add_request("r6", [1, 2, 3], SamplingParams(max_tokens=2))
