"""Nothing a request leaves behind outlives it: after many requests of every ending (finished,
stopped, cancelled, timed out, refused, invalid, n > 1, seeded, penalised, constrained) every
per-request structure of the engine and of AsyncLLMEngine is back to its size before them.

A server that keeps one entry per finished request grows without bound; bench/soak.py sees that only
as a slow rise of RSS over thousands of requests. Here each structure is looked at by name, so a
leak fails the test at once and says where it is.
"""

from __future__ import annotations

import asyncio
import gc

import torch

from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.config import EngineConfig
from pagedserve.core.errors import EngineOverloaded, PagedServeError
from pagedserve.core.request import Sample
from pagedserve.core.sampling_params import SamplingParams

ROUNDS = 3
"""Rounds of the mix below: a structure that keeps one entry per request grows every round."""


def per_request_sizes(engine: AsyncLLMEngine) -> dict[str, int]:
    """Size of every structure that holds something per request, by name."""
    inner = engine._engine
    sched = inner.scheduler
    return {
        "AsyncLLMEngine._streams": len(engine._streams),
        "AsyncLLMEngine.num_unfinished_requests": engine.num_unfinished_requests,
        "AsyncLLMEngine._commands": engine._commands.qsize(),
        "LLMEngine._requests": len(inner._requests),
        "Scheduler.samples": len(sched.samples),
        "Scheduler.waiting": len(sched.waiting),
        "Scheduler.running": len(sched.running),
        "Scheduler._ended": len(sched._ended),
        "KVCacheManager._samples": len(inner.kv_cache_manager._samples),
        "KVCacheManager used blocks": inner.kv_cache_manager.num_used_blocks,
        "Sampler._cache": len(inner.runner.sampler._cache),
        "StructuredOutputManager._states": len(inner.structured_output._states),
        # Finished samples stay in the deadline heap until their deadline passes (or a compaction).
        "Deadlines._heap (unfinished)": sum(not e[2].status.finished for e in sched.deadlines._heap),
        "metric label sets": len(inner.metrics._finished) + len(inner.metrics._refused),
    }


def live_request_objects() -> int:
    gc.collect()
    return sum(isinstance(o, Sample) for o in gc.get_objects())


def test_every_per_request_structure_returns_to_its_baseline(tiny_model_dir):
    config = EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32",
                                     "max_num_seqs": 4, "max_num_batched_tokens": 64,
                                     "max_waiting_requests": 6, "max_model_len": 256})
    engine = AsyncLLMEngine(config)
    inner = engine._engine
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(1, 384, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()

    async def one(i: int) -> str:
        kind = i % 9
        params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        timeout, cancel_after = None, None
        if kind == 1:
            params.update(temperature=0.9, seed=i, repetition_penalty=1.3)  # the sampler's per-sample cache
        elif kind == 2:
            params.update(n=2, temperature=0.8)
        elif kind == 3:
            params.update(max_tokens=200)
            cancel_after = 2
        elif kind == 4:
            params.update(max_tokens=200)
            timeout = 0.05
        elif kind == 5:
            params.update(stop=[inner.tokenizer.decode([7])])
        elif kind == 6:
            params = {"max_tokens": 8, "temperature": 0.0, "structured_outputs": {"choice": ["yes", "no"]}}
        elif kind == 7:
            params.update(max_tokens=10_000)  # too long for max_model_len: refused before it is queued
        try:
            stream = engine.generate(f"r{i}", prompt(), SamplingParams.from_dict(params), timeout=timeout)
            got = 0
            async for out in stream:
                got += len(out.new_token_ids)
                if cancel_after is not None and got >= cancel_after:
                    await stream.aclose()
                    return "cancelled"
                if out.finished and kind != 2:
                    return out.finish_reason
            return "n=2"
        except EngineOverloaded:
            return "refused"
        except PagedServeError:
            return "invalid"

    async def rounds() -> tuple[list[dict[str, int]], list[int], list[str]]:
        sizes, objects, endings = [], [], []
        tasks = len(asyncio.all_tasks())
        for r in range(ROUNDS):
            # Half at once (more than max_num_seqs + max_waiting_requests: some are refused), half in turn.
            endings += await asyncio.gather(*(one(r * 100 + i) for i in range(18)))
            for i in range(18, 27):
                endings.append(await one(r * 100 + i))
            await asyncio.sleep(0.2)  # the deadlines of the timed-out ones have passed
            await _idle(engine)
            # One more step: it hands the samples that finished in the last one to the sampler and
            # the grammar manager (SchedulerOutput.finished_seq_ids) and drops passed deadlines.
            async for _ in engine.generate(f"flush{r}", [1, 2], SamplingParams(max_tokens=1)):
                pass
            await _idle(engine)
            sizes.append(per_request_sizes(engine))
            leftover_streams.append(list(engine._streams))
            objects.append(live_request_objects())
            assert len(asyncio.all_tasks()) == tasks, "a task outlived its request"
        return sizes, objects, endings

    leftover_streams: list[list[str]] = []
    try:
        sizes, objects, endings = asyncio.run(asyncio.wait_for(rounds(), timeout=240))
        # Every ending was exercised, so every path that drops a request's state was taken.
        for ending in ("length", "stop", "cancelled", "timeout", "refused", "invalid", "n=2"):
            assert ending in endings, f"no request ended {ending!r}: {sorted(set(endings))}"
        for name, size in sizes[-1].items():
            if name != "metric label sets":
                assert size == 0, f"{name} holds {size} entries after every request ended: {sizes}; " \
                                  f"streams left: {leftover_streams}"
        assert sizes[-1]["metric label sets"] == sizes[0]["metric label sets"] <= 8
        # Finished samples still referenced (the last step's finished list, the deadline heap) are
        # bounded; one leaked per request would add ~27 per round.
        assert objects[-1] <= objects[0] + 4, f"Sample objects alive after each round: {objects}"
        inner.kv_cache_manager.check_invariants()
    finally:
        engine.shutdown()


async def _idle(engine: AsyncLLMEngine, timeout: float = 30.0) -> None:
    """Wait until no request is left, then until the engine thread is done with the last step's
    bookkeeping too (it forgets a stream just after handing the final output over), or `timeout`:
    the assertions then report what is left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline and (engine._engine.has_unfinished_requests() or engine.num_unfinished_requests
                                      or engine._commands.qsize() or engine._streams):
        await asyncio.sleep(0.01)
