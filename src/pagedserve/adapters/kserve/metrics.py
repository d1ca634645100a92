"""Engine metrics on kserve's /metrics: a prometheus_client Collector over the shared table.

kserve serves prometheus_client's default REGISTRY; registering this collector there adds the
engine families to that same page. Values are read at scrape time from the engine's frozen
MetricsSnapshot (lock-free, docs/design.md), so nothing is updated on the request path.

Each family is exported twice (adapters/engine_metrics.py): as `pagedserve:x` with the labels
`model` and `version`, and, where vLLM has it, as `vllm:x` with vLLM's OpenAI server's label
`model_name`; then `vllm:cache_config_info`, and `vllm:lora_requests_info` when LoRA is on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pagedserve.adapters.engine_metrics import (CACHE_CONFIG_DESCRIPTION, CACHE_CONFIG_INFO, ENGINE_METRICS,
                                                LABELLED_COUNTERS, LORA_INFO, LORA_INFO_DESCRIPTION,
                                                VLLM_LABELLED_COUNTERS, VLLM_METRICS, EngineMetric, LabelledCounter,
                                                MetricKind, cache_config_labels, cumulative_buckets, lora_info_labels)
from pagedserve.core.async_engine import ModelInfo
from pagedserve.core.metrics import MetricsSnapshot

if TYPE_CHECKING:  # only its attributes are read: no engine import for the exporter
    from pagedserve.core.lora import LoRAStats

LABELS = ("model", "version")
VLLM_LABELS = ("model_name",)
"""vLLM's OpenAI server labels its families with the served model's name only."""


class EngineMetricsCollector:
    def __init__(self, read_snapshot: Callable[[], MetricsSnapshot | None], model: str, version: str,
                 read_model_info: Callable[[], ModelInfo | None] = lambda: None,
                 read_lora_stats: Callable[[], LoRAStats | None] = lambda: None) -> None:
        self._read = read_snapshot
        """None until the engine exists: then nothing is exported (no made-up zeros)."""
        self._read_info = read_model_info
        self._read_lora = read_lora_stats
        """None unless the engine serves LoRA adapters (vllm:lora_requests_info is then left out, as by vLLM)."""
        self._labels = [model, version]
        self._vllm_labels = [model]

    def describe(self) -> list[Metric]:
        # Without describe() the registry would call collect() at registration, before the engine exists.
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._read()
        if snap is None:
            return
        yield from _families(snap, ENGINE_METRICS, LABELLED_COUNTERS, LABELS, self._labels)
        yield from _families(snap, VLLM_METRICS, VLLM_LABELLED_COUNTERS, VLLM_LABELS, self._vllm_labels)
        info = self._read_info()
        if info is not None:
            cache = cache_config_labels(info)
            family = GaugeMetricFamily(CACHE_CONFIG_INFO, CACHE_CONFIG_DESCRIPTION, labels=(*VLLM_LABELS, *cache))
            family.add_metric([*self._vllm_labels, *cache.values()], 1.0)
            yield family
        lora = self._read_lora()
        if lora is not None:  # vLLM's labels only (no model_name), its value the time of this reading
            labels = lora_info_labels(lora)
            family = GaugeMetricFamily(LORA_INFO, LORA_INFO_DESCRIPTION, labels=tuple(labels))
            family.add_metric(list(labels.values()), time.time())
            yield family


def _families(snap: MetricsSnapshot, metrics: tuple[EngineMetric, ...], counters: tuple[LabelledCounter, ...],
              label_names: tuple[str, ...], labels: list[str]) -> Iterator[Metric]:
    for metric in metrics:
        value = metric.read(snap)
        if metric.kind is MetricKind.GAUGE:
            family = GaugeMetricFamily(metric.name, metric.description, labels=label_names)
            family.add_metric(labels, value)
        elif metric.kind is MetricKind.COUNTER:
            family = CounterMetricFamily(metric.base_name, metric.description, labels=label_names)
            family.add_metric(labels, value)
        else:
            family = HistogramMetricFamily(metric.name, metric.description, labels=label_names)
            family.add_metric(labels, [(floatToGoString(b), c) for b, c in cumulative_buckets(value)],
                              sum_value=value.sum)
        yield family
    for counter in counters:
        family = CounterMetricFamily(counter.base_name, counter.description, labels=(*label_names, counter.label))
        for value, count in sorted(counter.read(snap).items()):
            family.add_metric([*labels, value], count)
        yield family
