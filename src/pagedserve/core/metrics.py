"""Engine statistics that adapters export (Triton MetricFamily, Prometheus).

Only the engine thread touches EngineMetrics. After every step it publishes a frozen
MetricsSnapshot (one reference assignment, atomic in Python), which adapters read from any thread
without a lock. Names follow vLLM's so dashboards carry over; the adapters add the `pagedserve:`
prefix and their labels.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Bucket upper bounds in seconds (vLLM's choices, so existing dashboards read the same).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    """Non-cumulative count per bucket, plus one overflow bucket (+Inf)."""
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass(frozen=True)
class MetricsSnapshot:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    """Fraction of KV blocks in use, 0..1 (vLLM's name, vLLM's unit)."""
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    request_success_total: dict[str, int]
    """finish_reason -> finished requests."""
    request_refused_total: dict[str, int]
    """reason (waiting_requests, waiting_prompt_tokens) -> requests refused at once (overload)."""
    engine_step_failures_total: int
    """Engine steps that raised; each ended every request in flight with an error."""
    time_to_first_token_seconds: Histogram
    inter_token_latency_seconds: Histogram
    e2e_request_latency_seconds: Histogram


class EngineMetrics:
    def __init__(self) -> None:
        self._gauges = dict(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0.0,
                            prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                            num_preemptions_total=0, prompt_tokens_total=0, generation_tokens_total=0)
        self._finished: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._step_failures = 0
        self._ttft = Histogram(TTFT_BUCKETS)
        self._itl = Histogram(ITL_BUCKETS)
        self._e2e = Histogram(E2E_BUCKETS)

    def update_from_scheduler(self, stats) -> None:
        self._gauges.update(
            num_requests_running=stats.num_running,
            num_requests_waiting=stats.num_waiting,
            kv_cache_usage_perc=stats.kv_cache_usage,
            prefix_cache_queries_total=stats.prefix_cache_queries_total,
            prefix_cache_hits_total=stats.prefix_cache_hits_total,
            num_preemptions_total=stats.num_preemptions_total,
            prompt_tokens_total=stats.num_prompt_tokens_total,
            generation_tokens_total=stats.num_generation_tokens_total,
        )

    def observe_first_token(self, ttft: float) -> None:
        self._ttft.observe(ttft)

    def observe_inter_token(self, itl: float) -> None:
        self._itl.observe(itl)

    def observe_finished(self, finish_reason: str, e2e: float) -> None:
        self._finished[finish_reason] = self._finished.get(finish_reason, 0) + 1
        self._e2e.observe(e2e)

    def observe_refused(self, reason: str) -> None:
        self._refused[reason] = self._refused.get(reason, 0) + 1

    def observe_step_failure(self) -> None:
        self._step_failures += 1

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(**self._gauges, request_success_total=dict(self._finished),
                               request_refused_total=dict(self._refused),
                               engine_step_failures_total=self._step_failures,
                               time_to_first_token_seconds=self._ttft.copy(),
                               inter_token_latency_seconds=self._itl.copy(),
                               e2e_request_latency_seconds=self._e2e.copy())
