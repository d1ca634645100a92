"""Replay a workload in-process against one engine and measure what an SLO is written in.

Requests are added when the wall clock reaches their arrival time; each is decoded greedily with
EOS ignored, so it produces exactly its recorded output length. While the engine is idle and the
next arrival is in the future, the clock skips ahead instead of sleeping: nothing runs in that
gap, so no latency changes, and a sparse workload replays in the time its busy periods take.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.core.sampling_params import SamplingParams
from pagedserve.core.workload import WorkloadItem


@dataclass(frozen=True)
class ReplayResult:
    num_requests: int
    output_tokens: int
    wall_s: float
    """From the first arrival to the last token, as a real clock would see it (idle gaps count,
    they are only not waited for). With arrivals spread out, throughput is bounded by the offered load."""
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_s: float
    itl_p95_s: float
    kv_usage_peak: float
    kv_usage_mean: float
    num_preemptions: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(int(-(-q * len(ordered) // 100)), 1)  # ceil(q/100 * n), at least the first
    return ordered[min(rank, len(ordered)) - 1]


def prompt_ids_for(items: Sequence[WorkloadItem], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The recorded ids, or seeded random ids of the recorded length (no text was recorded)."""
    rng = random.Random(seed)
    low = min(3, vocab_size - 1)  # skip the first few ids, usually special tokens
    return [list(it.prompt_ids) if it.prompt_ids is not None
            else [rng.randrange(low, vocab_size) for _ in range(it.prompt_tokens)] for it in items]


def replay(engine, items: Sequence[WorkloadItem], prompts: Sequence[Sequence[int]] | None = None) -> ReplayResult:
    """Run the workload on `engine` (idle on entry) and return its latency/throughput figures."""
    prompts = prompts if prompts is not None else prompt_ids_for(items, engine.arch.vocab_size)
    base_preemptions = engine.stats.num_preemptions_total
    arrival: dict[str, float] = {}
    last_token: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    usage: list[float] = []
    output_tokens = 0
    skipped = 0.0  # idle time skipped so far
    start = time.perf_counter()
    nxt = 0
    while nxt < len(items) or engine.has_unfinished_requests():
        now = time.perf_counter() - start + skipped
        if not engine.has_unfinished_requests() and items[nxt].arrival_time > now:
            skipped += items[nxt].arrival_time - now
            now = items[nxt].arrival_time
        while nxt < len(items) and items[nxt].arrival_time <= now:
            it = items[nxt]
            rid = f"replay-{nxt}"
            engine.add_request(rid, prompts[nxt], SamplingParams(temperature=0.0, max_tokens=it.output_tokens,
                                                                 ignore_eos=True), detokenize=False)
            arrival[rid] = it.arrival_time
            nxt += 1
        outputs = engine.step()
        t = time.perf_counter() - start + skipped
        usage.append(engine.stats.kv_cache_usage)
        for out in outputs:
            if not out.new_token_ids:
                continue
            output_tokens += len(out.new_token_ids)
            prev = last_token.get(out.request_id)
            if prev is None:
                ttft.append(t - arrival[out.request_id])
            else:
                # tokens of one step arrive together: each is one inter-token gap of the step's share
                itl.extend([(t - prev) / len(out.new_token_ids)] * len(out.new_token_ids))
            last_token[out.request_id] = t
    wall = time.perf_counter() - start + skipped - (items[0].arrival_time if items else 0.0)
    return ReplayResult(
        num_requests=len(items), output_tokens=output_tokens, wall_s=wall,
        ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95),
        itl_p50_s=percentile(itl, 50), itl_p95_s=percentile(itl, 95),
        kv_usage_peak=max(usage, default=0.0), kv_usage_mean=statistics.fmean(usage) if usage else 0.0,
        num_preemptions=engine.stats.num_preemptions_total - base_preemptions,
    )
