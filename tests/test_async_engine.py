"""AsyncLLMEngine: concurrent streams, cancellation, external abort, failures that never hang."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import (DuplicateRequest, EngineDead, EngineOverloaded, EngineShuttingDown,
                                    EngineStepFailed, InvalidRequest, RequestTooLong)
from pagedserve.core.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 384, (int(k),), generator=g).tolist() for k in torch.randint(2, 60, (n,), generator=g)]


@pytest.fixture
def engine_config(tiny_model_dir):
    return EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32",
                                   "max_num_seqs": 16, "max_num_batched_tokens": 128})


async def collect(engine: AsyncLLMEngine, rid: str, prompt, params, cancel_after: int | None = None):
    tokens: list[int] = []
    text = []
    final = None
    stream = engine.generate(rid, prompt, params)
    async for out in stream:
        tokens.extend(out.new_token_ids)
        text.append(out.text)
        if out.finished:
            final = out
        if cancel_after is not None and len(tokens) >= cancel_after:
            await stream.aclose()
            break
    return tokens, "".join(text), final


def test_fifty_concurrent_streams_with_cancellations(engine_config):
    ps = prompts(50, seed=1)
    # Cancelled requests (i % 5 == 0) are long, so the cancel always lands before they finish.
    lens = [400 if i % 5 == 0 else 8 + (i % 17) for i in range(50)]
    offline = LLMEngine(engine_config).generate(ps, [SamplingParams(max_tokens=n, **GREEDY) for n in lens])
    engine = AsyncLLMEngine(engine_config)

    async def main():
        tasks = [collect(engine, f"r{i}", ps[i], SamplingParams(max_tokens=lens[i], **GREEDY),
                         cancel_after=3 if i % 5 == 0 else None) for i in range(50)]
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for i, (tokens, text, final) in enumerate(results):
        if i % 5 == 0:
            assert tokens == list(offline[i].token_ids[: len(tokens)]) and len(tokens) >= 3
            continue
        assert tokens == list(offline[i].token_ids), f"request {i}"
        assert text == offline[i].text
        assert final.finish_reason == "length" and final.timing is not None
    _wait_idle(engine)
    kv = engine._engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == engine._engine.num_kv_blocks
    m = engine.metrics
    assert m.num_requests_running == 0 and m.kv_cache_usage_perc == 0.0
    assert m.request_success_total.get("length") == 40 and m.request_success_total.get("abort") == 10
    assert m.time_to_first_token_seconds.count == 50
    assert m.e2e_request_latency_seconds.count == 50
    engine.shutdown()


def _wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while engine._engine.has_unfinished_requests() or engine.metrics.num_requests_running:
        assert time.monotonic() < deadline, "aborted requests were not freed"
        time.sleep(0.01)


def test_abort_from_outside_ends_stream_and_frees_blocks(engine_config):
    engine = AsyncLLMEngine(engine_config)

    async def main():
        got = []
        async for out in engine.generate("x", prompts(1, 2)[0], SamplingParams(max_tokens=200, **GREEDY)):
            got.append(out)
            if len(got) == 2:
                engine.abort("x")
        return got

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    _wait_idle(engine)
    assert engine._engine.kv_cache_manager.num_free_blocks == engine._engine.num_kv_blocks
    engine.shutdown()


def test_bad_request_is_rejected_alone(engine_config):
    engine = AsyncLLMEngine(engine_config)

    async def main():
        good = collect(engine, "good", prompts(1, 3)[0], SamplingParams(max_tokens=10, **GREEDY))
        too_long = collect(engine, "long", [5] * 2000, SamplingParams(max_tokens=5))
        bad_ids = collect(engine, "bad", [1, 2, 10**6], SamplingParams(max_tokens=5))
        return await asyncio.gather(good, too_long, bad_ids, return_exceptions=True)

    good, too_long, bad_ids = asyncio.run(main())
    assert len(good[0]) == 10 and good[2].finish_reason == "length"
    assert isinstance(too_long, RequestTooLong) and "max_model_len" in str(too_long)
    assert isinstance(bad_ids, InvalidRequest) and "token ids" in str(bad_ids)
    assert engine.is_healthy()
    engine.shutdown()


def test_duplicate_request_id_is_rejected(engine_config):
    engine = AsyncLLMEngine(engine_config)

    async def main():
        # The duplicate goes in once the first has streamed a token, so it is running then (a
        # duplicate sent right after a short first request could find it finished under load);
        # 300 tokens leave the first running while the duplicate is refused.
        tokens, second = [], None
        async for out in engine.generate("same", [1, 2, 3], SamplingParams(max_tokens=300, **GREEDY)):
            tokens.extend(out.new_token_ids)
            if second is None:
                second = (await asyncio.gather(collect(engine, "same", [4, 5], SamplingParams(max_tokens=3)),
                                               return_exceptions=True))[0]
        return tokens, second

    first_tokens, second = asyncio.run(main())
    assert len(first_tokens) == 300  # the refused duplicate did not disturb the first
    assert isinstance(second, DuplicateRequest)
    engine.shutdown()


def _fail_steps(engine: AsyncLLMEngine, times: int, live: int) -> None:
    """Make the next `times` engine steps that run with `live` requests in flight raise, as a
    broken kernel would."""
    real_step = engine._engine.step
    left = {"n": times}

    def flaky_step():
        if left["n"] and len(engine._engine.scheduler.samples) >= live:
            left["n"] -= 1
            raise RuntimeError("injected kernel failure")
        return real_step()

    engine._engine.step = flaky_step


def _throttle(engine: AsyncLLMEngine, seconds: float) -> None:
    """At least `seconds` per step, so how long a request runs does not depend on machine speed."""
    import time

    real_step = engine._engine.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    engine._engine.step = slow_step


def _fail_once_all_are_in(engine: AsyncLLMEngine, live: int, passes_first: int) -> None:
    """Run no step until `live` requests are in the engine, let `passes_first` forward passes run
    with all of them, then make the next forward pass raise, as a broken kernel would (after the
    scheduler gave that step its blocks). Holding the steps makes the overlap certain: run free, a
    request could finish before the last one arrived, on a busy machine."""
    import time

    inner = engine._engine
    real_step, real_execute = inner.step, inner.runner.execute
    left = {"passes": passes_first, "fault": 1}

    def held_step():
        if left["fault"] and len(inner.scheduler.samples) < live:
            time.sleep(0.001)  # the engine thread takes the next command, then comes back
            return []
        return real_step()

    def execute(*args, **kwargs):
        if left["fault"]:
            if not left["passes"]:
                left["fault"] = 0
                raise RuntimeError("injected kernel failure")
            left["passes"] -= 1
        return real_execute(*args, **kwargs)

    inner.step, inner.runner.execute = held_step, execute


def test_step_failure_ends_every_stream_and_the_engine_recovers(engine_config):
    engine = AsyncLLMEngine(engine_config)
    offline = LLMEngine(engine_config)
    # Three passes with all five (their prompts, 300 tokens at most, prefill in three 128-token
    # steps at most), then the fault: none of them is near its 50 tokens.
    _fail_once_all_are_in(engine, live=5, passes_first=3)
    ps = prompts(5, 4)

    async def main():
        tasks = [collect(engine, f"f{i}", p, SamplingParams(max_tokens=50, **GREEDY)) for i, p in enumerate(ps)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
        # The same prompts again: the prefix cache was reset, so no block written in the failed
        # step (or never written) can be reused; the text must equal the offline engine's.
        again = await asyncio.wait_for(asyncio.gather(
            *(collect(engine, f"g{i}", p, SamplingParams(max_tokens=12, **GREEDY)) for i, p in enumerate(ps))),
            timeout=60)
        return results, again

    results, again = asyncio.run(main())
    assert all(isinstance(r, EngineStepFailed) and "injected kernel failure" in str(r) for r in results), results
    want = offline.generate(ps, SamplingParams(max_tokens=12, **GREEDY))
    assert [tokens for tokens, _, _ in again] == [list(w.token_ids) for w in want]
    assert engine.is_healthy()
    assert engine.metrics.engine_step_failures_total == 1
    _wait_idle(engine)
    engine._engine.kv_cache_manager.check_invariants()
    assert engine._engine.kv_cache_manager.num_free_blocks == engine._engine.num_kv_blocks
    engine.shutdown()


def test_repeated_step_failures_kill_the_engine_and_nothing_hangs(engine_config):
    engine = AsyncLLMEngine(engine_config)
    _fail_steps(engine, times=3, live=1)

    async def main():
        outcomes = []
        for i in range(3):  # each request meets one failed step in a row
            outcomes += await asyncio.wait_for(asyncio.gather(
                collect(engine, f"f{i}", [1, 2, 3], SamplingParams(max_tokens=5)), return_exceptions=True), 30)
        later = await asyncio.wait_for(asyncio.gather(
            collect(engine, "late", [1, 2], SamplingParams(max_tokens=2)), return_exceptions=True), timeout=10)
        return outcomes, later[0]

    outcomes, later = asyncio.run(main())
    assert [type(o) for o in outcomes] == [EngineStepFailed] * 3  # each ended by its failed step
    assert isinstance(later, EngineDead) and "restart" in str(later)
    assert not engine.is_healthy()
    engine.shutdown()


def test_after_shutdown_every_call_fails_fast(engine_config):
    engine = AsyncLLMEngine(engine_config)
    _throttle(engine, 0.005)  # 400 tokens take >= 2 s, so the stream is still open at shutdown

    async def main():
        running = asyncio.ensure_future(collect(engine, "r", [1, 2, 3], SamplingParams(max_tokens=400, **GREEDY)))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(engine.shutdown)
        # A stream open at shutdown, a request after it, and requests racing it all end at once.
        return await asyncio.wait_for(asyncio.gather(
            running, collect(engine, "after", [1, 2], SamplingParams(max_tokens=2)),
            *(collect(engine, f"x{i}", "some text", SamplingParams(max_tokens=2)) for i in range(4)),
            return_exceptions=True), timeout=10)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineShuttingDown) for r in results), results
    assert not engine.is_healthy()
    engine.abort("after")  # a no-op now, never an error
    engine.shutdown()  # idempotent


def test_drain_lets_requests_finish_then_cuts_off_the_rest(engine_config):
    engine = AsyncLLMEngine(engine_config)
    _throttle(engine, 0.005)  # the long request needs at least 4.5 s, the drain period is 1 s

    async def main():
        short = asyncio.ensure_future(collect(engine, "short", [1, 2, 3], SamplingParams(max_tokens=5, **GREEDY)))
        long = asyncio.ensure_future(collect(engine, "long", [4, 5, 6], SamplingParams(max_tokens=900, **GREEDY)))
        await asyncio.sleep(0)
        while engine.num_unfinished_requests < 2:
            await asyncio.sleep(0.01)
        drained = asyncio.ensure_future(engine.drain(timeout=1.0))
        await asyncio.sleep(0.05)
        refused = await asyncio.gather(collect(engine, "new", [7], SamplingParams(max_tokens=2)),
                                       return_exceptions=True)
        return await drained, await short, await asyncio.gather(long, return_exceptions=True), refused

    cut_off, short, (long,), (refused,) = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert short[2].finish_reason == "length" and len(short[0]) == 5  # finished within the period
    assert isinstance(long, EngineShuttingDown) and "drain period" in str(long)
    assert isinstance(refused, EngineShuttingDown) and "accepts no new requests" in str(refused)
    assert cut_off == 1 and not engine.is_healthy()


def test_overload_refuses_at_once_by_count_and_by_prompt_tokens(engine_config):
    # One request runs (max_num_seqs=1); the queue holds at most 2 requests and 40 prompt tokens.
    config = engine_config.replace(max_num_seqs=1, max_waiting_requests=2, max_waiting_prompt_tokens=40)
    engine = AsyncLLMEngine(config)
    # 0.25 s a step: the 300-token request needs 75 s, more than the test's 60 s timeout, so it is
    # certainly running (and the queue full) until the test aborts it. Run free, it sometimes
    # finished first on a busy machine and the queued requests were admitted (or waited for forever).
    _throttle(engine, 0.25)

    async def main():
        runner = asyncio.ensure_future(collect(engine, "run", [1, 2, 3], SamplingParams(max_tokens=300, **GREEDY)))
        while engine.metrics.num_requests_running < 1:
            await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(collect(engine, f"q{i}", [5] * 15, SamplingParams(max_tokens=2)))
                  for i in range(2)]
        while engine.metrics.num_requests_waiting < 2:
            await asyncio.sleep(0.01)
        (by_count,) = await asyncio.gather(collect(engine, "over", [6] * 3, SamplingParams(max_tokens=2)),
                                           return_exceptions=True)
        engine.abort("q1")
        while engine.metrics.num_requests_waiting > 1:
            await asyncio.sleep(0.01)
        (by_tokens,) = await asyncio.gather(collect(engine, "big", [7] * 30, SamplingParams(max_tokens=2)),
                                            return_exceptions=True)
        fits = asyncio.ensure_future(collect(engine, "fits", [8] * 20, SamplingParams(max_tokens=2)))
        engine.abort("run")
        await runner  # not dropped: the loop holds tasks weakly, and an error in it must surface here
        return by_count, by_tokens, await fits, await queued[0]

    by_count, by_tokens, fits, first = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert isinstance(by_count, EngineOverloaded) and "max_waiting_requests=2" in str(by_count)
    assert isinstance(by_tokens, EngineOverloaded) and "max_waiting_prompt_tokens=40" in str(by_tokens)
    assert fits[2].finish_reason == "length" and first[2].finish_reason == "length"
    assert engine.metrics.request_refused_total == {"waiting_requests": 1, "waiting_prompt_tokens": 1}
    engine.shutdown()


def test_deadlines_end_requests_with_timeout_and_free_their_blocks(engine_config):
    # The engine-wide default (request_timeout) and a request's own timeout, which wins; one
    # request times out while still waiting for a slot (max_num_seqs=1).
    engine = AsyncLLMEngine(engine_config.replace(request_timeout=0.5, max_num_seqs=1))
    _throttle(engine, 0.005)  # 900 tokens need at least 4.5 s

    async def main():
        default = asyncio.ensure_future(collect(engine, "d", [1, 2, 3], SamplingParams(max_tokens=900, **GREEDY)))
        waiting = asyncio.ensure_future(_collect_timeout(engine, "w", [4, 5], 0.2))
        own = await _collect_timeout(engine, "own", [6, 7], 30.0)  # runs after the others end
        return await default, await waiting, own

    default, waiting, own = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert default[2].finish_reason == "timeout" and 0 < len(default[0]) < 900
    assert waiting[2].finish_reason == "timeout" and waiting[0] == []
    assert own[2].finish_reason == "length" and len(own[0]) == 20
    _wait_idle(engine)
    assert engine._engine.kv_cache_manager.num_free_blocks == engine._engine.num_kv_blocks
    assert engine.metrics.request_success_total == {"timeout": 2, "length": 1}
    engine.shutdown()


async def _collect_timeout(engine, rid, prompt, timeout):
    tokens, final = [], None
    async for out in engine.generate(rid, prompt, SamplingParams(max_tokens=20, **GREEDY), timeout=timeout):
        tokens.extend(out.new_token_ids)
        final = out if out.finished else final
    return tokens, None, final


def test_prompts_are_tokenized_off_the_engine_thread_and_huge_ones_never(engine_config):
    import threading

    engine = AsyncLLMEngine(engine_config)
    tokenizer = engine._engine.tokenizer
    seen: list[tuple[int, int]] = []
    real_encode = tokenizer.encode

    def recording_encode(text, *args, **kwargs):
        seen.append((threading.get_ident(), len(text)))
        return real_encode(text, *args, **kwargs)

    tokenizer.encode = recording_encode
    huge = "x" * (engine.model_info.max_prompt_chars + 1)

    async def main():
        ok = await collect(engine, "ok", "The paged KV cache", SamplingParams(max_tokens=3, **GREEDY))
        (refused,) = await asyncio.gather(collect(engine, "huge", huge, SamplingParams(max_tokens=3)),
                                          return_exceptions=True)
        return ok, refused

    ok, refused = asyncio.run(main())
    assert len(ok[0]) == 3
    assert isinstance(refused, RequestTooLong) and "characters" in str(refused)
    assert [n for _, n in seen] == [len("The paged KV cache")]  # the huge prompt was never tokenized
    assert seen[0][0] not in (engine._thread.ident, threading.get_ident())
    engine.shutdown()


def test_samples_finishing_in_the_same_step_all_reach_the_stream(engine_config):
    # n=3 seeded: sample 0 runs one step ahead of its followers, so samples 1 and 2 finish together
    # in one step; each of the three samples must still deliver its final output (none may hang).
    engine = AsyncLLMEngine(engine_config)
    params = SamplingParams(max_tokens=10, temperature=0.9, n=3, seed=11)
    prompt = prompts(1, 5)[0]
    offline = LLMEngine(engine_config).generate([prompt], params)

    async def main():
        outs = []
        async for out in engine.generate("n3", prompt, params):
            outs.append(out)
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), timeout=60))
    finals = sorted((o.index, o.finish_reason) for o in outs if o.finished)
    assert finals == [(0, "length"), (1, "length"), (2, "length")]
    for k in range(3):
        assert [t for o in outs if o.index == k for t in o.new_token_ids] == list(offline[k].token_ids)
    engine.shutdown()


def test_engine_is_built_and_stepped_on_one_thread(engine_config, monkeypatch):
    # torch's OpenMP team belongs to the thread that runs an op; building on the caller's thread and
    # stepping on the engine thread leaves two teams, which measured 35% slower on 2 cores.
    import threading

    import pagedserve.core.async_engine as async_engine_module

    seen: dict[str, int] = {}

    class Recording(LLMEngine):
        def __init__(self, config):
            seen["build"] = threading.get_ident()
            super().__init__(config)

        def step(self):
            seen["step"] = threading.get_ident()
            return super().step()

    monkeypatch.setattr(async_engine_module, "LLMEngine", Recording)
    engine = AsyncLLMEngine(engine_config)

    async def main():
        return await collect(engine, "r", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))

    tokens, _, _ = asyncio.run(main())
    engine.shutdown()
    assert len(tokens) == 2
    assert seen["build"] == seen["step"] == engine._thread.ident != threading.get_ident()


def test_a_failed_build_raises_from_the_constructor(tmp_path):
    with pytest.raises(Exception, match="is not a directory"):
        AsyncLLMEngine(EngineConfig.from_dict({"model": str(tmp_path / "missing")}))

