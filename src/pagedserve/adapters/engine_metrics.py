"""The engine metrics every adapter exports, named once so Triton and KServe dashboards agree.

Each adapter reads the engine's lock-free MetricsSnapshot (core/metrics.py) and publishes these
families through its platform's API: `pb_utils.MetricFamily` on Triton's metrics port,
prometheus_client on KServe's `/metrics`. Names are vLLM's under the `pagedserve:` prefix; every
sample carries the labels `model` and `version`.

The families vLLM also has are exported a second time, by default, under vLLM's own names
(`vllm:num_requests_waiting`, ...; `vllm_names`), with the labels vLLM's servers give them:
`model_name` on KServe (vLLM's OpenAI server), `model` and `version` on Triton (vllm_backend's).
Autoscalers (KEDA, the HPA's Prometheus adapter), routers (vllm-router, the production stack's)
and vLLM's Grafana dashboards query those names and take no prefix setting, so a pagedserve
replica is read as a vLLM one with no configuration. The cost is one more family per metric at
scrape time. `vllm:cache_config_info` (value 1) carries the KV cache's shape as labels
(`block_size`, `num_gpu_blocks`, ... as vLLM's), which routers read to size prefix-aware routing.
With LoRA on, `vllm:lora_requests_info` carries the adapters in use as labels (lora_info_labels),
which the Gateway API Inference Extension reads to route a request to a replica that already holds
its adapter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from pagedserve.core.metrics import Histogram, MetricsSnapshot

if TYPE_CHECKING:  # only their attributes are read: no engine import for the metric table
    from pagedserve.core.async_engine import ModelInfo
    from pagedserve.core.lora import LoRAStats

PREFIX = "pagedserve:"
VLLM_PREFIX = "vllm:"
CACHE_CONFIG_INFO = VLLM_PREFIX + "cache_config_info"
CACHE_CONFIG_DESCRIPTION = "Information of the KV cache's configuration (value 1; the settings are the labels)."
LORA_INFO = VLLM_PREFIX + "lora_requests_info"
LORA_INFO_DESCRIPTION = "Running stats on lora requests."
"""vLLM's name and help text. Exported only when the engine serves LoRA adapters, like vLLM's."""


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
    in_vllm: bool = True
    """vLLM exports it too: it is also exported under its vLLM name (vllm_names)."""

    @property
    def base_name(self) -> str:
        """The name without a counter's `_total` (prometheus_client appends it on exposition)."""
        return self.name.removesuffix("_total") if self.kind is MetricKind.COUNTER else self.name

    def renamed(self, name: str) -> "EngineMetric":
        return dataclasses.replace(self, name=name)


def _metric(name: str, kind: MetricKind, description: str, in_vllm: bool = True) -> EngineMetric:
    return EngineMetric(PREFIX + name, kind, description, lambda snap: getattr(snap, name), in_vllm)


def vllm_name(name: str) -> str:
    """`pagedserve:x` -> `vllm:x`."""
    return VLLM_PREFIX + name.removeprefix(PREFIX)


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
            "Engine steps that raised; each ended every request in flight with an error.", in_vllm=False),
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
    in_vllm: bool = True

    @property
    def base_name(self) -> str:
        return self.name.removesuffix("_total")

    def renamed(self, name: str) -> "LabelledCounter":
        return dataclasses.replace(self, name=name)


REQUEST_SUCCESS = LabelledCounter(PREFIX + "request_success_total", "finished_reason",
                                  "Finished requests, by finish reason (stop, length, abort, timeout).",
                                  lambda snap: snap.request_success_total)
"""vLLM's name and label."""
REQUEST_REFUSED = LabelledCounter(PREFIX + "request_refused_total", "reason",
                                  "Requests refused at once because the waiting queue was full, by the bound "
                                  "reached (waiting_requests, waiting_prompt_tokens).",
                                  lambda snap: snap.request_refused_total, in_vllm=False)
LABELLED_COUNTERS: tuple[LabelledCounter, ...] = (REQUEST_SUCCESS, REQUEST_REFUSED)


VLLM_METRICS: tuple[EngineMetric, ...] = tuple(m.renamed(vllm_name(m.name)) for m in ENGINE_METRICS if m.in_vllm)
VLLM_LABELLED_COUNTERS: tuple[LabelledCounter, ...] = tuple(c.renamed(vllm_name(c.name)) for c in LABELLED_COUNTERS
                                                            if c.in_vllm)
"""The same families under vLLM's names (module docstring), exported after the `pagedserve:` ones."""


def cache_config_labels(info: ModelInfo) -> dict[str, str]:
    """vllm:cache_config_info's labels (vLLM's CacheConfig field names, values as strings)."""
    return {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_kv_blocks),
            "cache_dtype": info.kv_cache_dtype, "enable_prefix_caching": str(info.enable_prefix_caching)}


def lora_info_labels(stats: LoRAStats) -> dict[str, str]:
    """vllm:lora_requests_info's labels, as vLLM sets them: the adapters of the running and of the
    waiting requests, each joined by commas (empty when none), and max_lora (adapters resident at
    once). Its value is the Unix time the labels were read: vLLM sets the gauge to the current time
    on every update, and routers (the Gateway API Inference Extension) take the newest sample."""
    return {"max_lora": str(stats.max_lora), "waiting_lora_adapters": ",".join(stats.waiting),
            "running_lora_adapters": ",".join(stats.running)}


def cumulative_buckets(hist: Histogram) -> list[tuple[float, int]]:
    """(upper bound, cumulative count) pairs ending with (+inf, count), Prometheus style."""
    out, total = [], 0
    for bound, count in zip((*hist.buckets, float("inf")), hist.counts):
        total += count
        out.append((bound, total))
    return out
