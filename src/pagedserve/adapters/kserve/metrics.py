"""Engine metrics on kserve's /metrics: a prometheus_client Collector over the shared table.

kserve serves prometheus_client's default REGISTRY; registering this collector there adds the
engine families to that same page. Values are read at scrape time from the engine's frozen
MetricsSnapshot (lock-free, docs/design.md), so nothing is updated on the request path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pagedserve.adapters.engine_metrics import ENGINE_METRICS, LABELLED_COUNTERS, MetricKind, cumulative_buckets
from pagedserve.core.metrics import MetricsSnapshot

LABELS = ("model", "version")


class EngineMetricsCollector:
    def __init__(self, read_snapshot: Callable[[], MetricsSnapshot | None], model: str, version: str) -> None:
        self._read = read_snapshot
        """None until the engine exists: then nothing is exported (no made-up zeros)."""
        self._labels = [model, version]

    def describe(self) -> list[Metric]:
        # Without describe() the registry would call collect() at registration, before the engine exists.
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._read()
        if snap is None:
            return
        for metric in ENGINE_METRICS:
            value = metric.read(snap)
            if metric.kind is MetricKind.GAUGE:
                family = GaugeMetricFamily(metric.name, metric.description, labels=LABELS)
                family.add_metric(self._labels, value)
            elif metric.kind is MetricKind.COUNTER:
                family = CounterMetricFamily(metric.base_name, metric.description, labels=LABELS)
                family.add_metric(self._labels, value)
            else:
                family = HistogramMetricFamily(metric.name, metric.description, labels=LABELS)
                family.add_metric(self._labels, [(floatToGoString(b), c) for b, c in cumulative_buckets(value)],
                                  sum_value=value.sum)
            yield family
        for counter in LABELLED_COUNTERS:
            family = CounterMetricFamily(counter.base_name, counter.description, labels=(*LABELS, counter.label))
            for value, count in sorted(counter.read(snap).items()):
                family.add_metric([*self._labels, value], count)
            yield family
