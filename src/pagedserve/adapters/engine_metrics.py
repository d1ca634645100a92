"""The engine metrics every adapter exports, named once so Triton and KServe dashboards agree.

Each adapter reads the engine's lock-free MetricsSnapshot (core/metrics.py) and publishes these
families through its platform's API: `pb_utils.MetricFamily` on Triton's metrics port,
prometheus_client on KServe's `/metrics`. Names are vLLM's under the `pagedserve:` prefix; every
sample carries the labels `model` and `version`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from pagedserve.core.metrics import Histogram, MetricsSnapshot

PREFIX = "pagedserve:"


class MetricKind(Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class EngineMetric:
    name: str
    """Full exported name, prefix included (Prometheus adds `_total`/`_bucket` suffixes itself
    for counters/histograms only where its client library does; see `base_name`)."""
    kind: MetricKind
    description: str
    read: Callable[[MetricsSnapshot], float | Histogram]

    @property
    def base_name(self) -> str:
        """The name without a counter's `_total` (prometheus_client appends it on exposition)."""
        return self.name.removesuffix("_total") if self.kind is MetricKind.COUNTER else self.name


def _metric(name: str, kind: MetricKind, description: str) -> EngineMetric:
    return EngineMetric(PREFIX + name, kind, description, lambda snap: getattr(snap, name))


ENGINE_METRICS: tuple[EngineMetric, ...] = (
    _metric("num_requests_running", MetricKind.GAUGE, "Requests in the running batch."),
    _metric("num_requests_waiting", MetricKind.GAUGE, "Requests waiting to be scheduled."),
    _metric("kv_cache_usage_perc", MetricKind.GAUGE, "Fraction of KV-cache blocks in use (1 = full)."),
    _metric("prefix_cache_queries_total", MetricKind.COUNTER, "Prompt tokens looked up in the prefix cache."),
    _metric("prefix_cache_hits_total", MetricKind.COUNTER, "Prompt tokens found in the prefix cache."),
    _metric("num_preemptions_total", MetricKind.COUNTER, "Requests preempted (KV blocks reclaimed, recomputed later)."),
    _metric("prompt_tokens_total", MetricKind.COUNTER, "Prompt tokens prefilled."),
    _metric("generation_tokens_total", MetricKind.COUNTER, "Tokens generated."),
    _metric("engine_step_failures_total", MetricKind.COUNTER,
            "Engine steps that raised; each ended every request in flight with an error."),
    _metric("time_to_first_token_seconds", MetricKind.HISTOGRAM, "Time from arrival to the first token."),
    _metric("inter_token_latency_seconds", MetricKind.HISTOGRAM, "Time between consecutive output tokens."),
    _metric("e2e_request_latency_seconds", MetricKind.HISTOGRAM, "Time from arrival to the last token."),
)
"""Exported in this order; the counters with a label follow in LABELLED_COUNTERS."""


@dataclass(frozen=True)
class LabelledCounter:
    """A counter family with one sample per value of `label` (values appear as they first occur)."""

    name: str
    label: str
    description: str
    read: Callable[[MetricsSnapshot], dict[str, int]]

    @property
    def base_name(self) -> str:
        return self.name.removesuffix("_total")


REQUEST_SUCCESS = LabelledCounter(PREFIX + "request_success_total", "finished_reason",
                                  "Finished requests, by finish reason (stop, length, abort, timeout).",
                                  lambda snap: snap.request_success_total)
"""vLLM's name and label."""
REQUEST_REFUSED = LabelledCounter(PREFIX + "request_refused_total", "reason",
                                  "Requests refused at once because the waiting queue was full, by the bound "
                                  "reached (waiting_requests, waiting_prompt_tokens).",
                                  lambda snap: snap.request_refused_total)
LABELLED_COUNTERS: tuple[LabelledCounter, ...] = (REQUEST_SUCCESS, REQUEST_REFUSED)


def cumulative_buckets(hist: Histogram) -> list[tuple[float, int]]:
    """(upper bound, cumulative count) pairs ending with (+inf, count), Prometheus style."""
    out, total = [], 0
    for bound, count in zip((*hist.buckets, float("inf")), hist.counts):
        total += count
        out.append((bound, total))
    return out
