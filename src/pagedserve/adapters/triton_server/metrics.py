"""Engine metrics on Triton's metrics port through pb_utils.MetricFamily.

The families and names come from adapters/engine_metrics.py (shared with KServe). A small thread
refreshes them from the engine's lock-free MetricsSnapshot every `interval` seconds, and at once
when `poke()` is called (after each finished request). Every family is exported under its
`pagedserve:` name and, where vLLM has it, under vLLM's (`vllm:`, with vllm_backend's labels
`model` and `version`), beside `vllm:cache_config_info` and, when the engine serves LoRA adapters,
`vllm:lora_requests_info` (vLLM's labels beside `model` and `version`; adapters/engine_metrics.py):

* gauges are set to the snapshot's value;
* counters are incremented by the change since the last refresh (MetricFamily counters only go up);
* histograms: the Python backend of Triton 2.51 has MetricFamily.HISTOGRAM, but a Metric only
  takes single observations (`observe(value)`), while the engine keeps the histogram itself (bucket
  counts and sum, core/metrics.py). Each refresh therefore replays the change as observations:
  exactly as many per bucket as the engine counted there, with values inside that bucket chosen so
  that their sum equals the engine's sum. The exported `_bucket`, `_count` and `_sum` series are
  then the engine's own, with the same bucket bounds. Cost: one backend call per observation.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.adapters.engine_metrics import (CACHE_CONFIG_DESCRIPTION, CACHE_CONFIG_INFO, ENGINE_METRICS,
                                                LABELLED_COUNTERS, LORA_INFO, LORA_INFO_DESCRIPTION,
                                                VLLM_LABELLED_COUNTERS, VLLM_METRICS, MetricKind, lora_info_labels)
from pagedserve.core.metrics import Histogram, MetricsSnapshot

if TYPE_CHECKING:  # only its attributes are read: no engine import for the exporter
    from pagedserve.core.lora import LoRAStats

EXPORTED_METRICS = (*ENGINE_METRICS, *VLLM_METRICS)
EXPORTED_LABELLED_COUNTERS = (*LABELLED_COUNTERS, *VLLM_LABELLED_COUNTERS)

logger = logging.getLogger(__name__)


def replay_observations(prev: Histogram | None, cur: Histogram) -> list[float]:
    """Values whose observation turns `prev` into `cur`: the right count in every bucket, the
    right total sum (up to float rounding)."""
    prev_counts = prev.counts if prev is not None else [0] * len(cur.counts)
    deltas = [c - p for c, p in zip(cur.counts, prev_counts)]
    target = cur.sum - (prev.sum if prev is not None else 0.0)
    # A value equal to a bound belongs to the bucket below it (Prometheus `le`), so each bucket's
    # smallest value is just above the previous bound.
    lows = [0.0, *(math.nextafter(b, math.inf) for b in cur.buckets)]
    highs = [*cur.buckets, math.inf]
    spans = [(lows[i], highs[i], d) for i, d in enumerate(deltas) if d > 0]
    if not spans:
        return []
    # Start every value at its bucket's lower end, then raise them toward the upper ends by one
    # common fraction (or let the +Inf bucket take the rest) until the sum matches.
    low_sum = sum(lo * d for lo, _hi, d in spans)
    finite = [(lo, hi, d) for lo, hi, d in spans if hi != math.inf]
    room = sum((hi - lo) * d for lo, hi, d in finite)
    over = next(((lo, d) for lo, hi, d in spans if hi == math.inf), None)
    extra = max(target - low_sum, 0.0)
    frac = 1.0 if room <= 0 else min(extra / room, 1.0) if over is None else 0.0
    values = []
    for lo, hi, d in finite:
        values += [lo + frac * (hi - lo)] * d
    if over is not None:
        lo, d = over
        values += [lo + extra / d] * d
    return values


class TritonEngineMetrics:
    def __init__(self, pb_utils, read_snapshot: Callable[[], MetricsSnapshot], labels: dict[str, str],
                 interval: float = 0.2, cache_config: dict[str, str] | None = None,
                 read_lora_stats: Callable[[], LoRAStats] | None = None) -> None:
        """cache_config: vllm:cache_config_info's labels (engine_metrics.cache_config_labels).
        read_lora_stats: the engine's adapters in use, when it serves LoRA (vllm:lora_requests_info)."""
        self.pb_utils = pb_utils
        self.read_snapshot = read_snapshot
        self.labels = labels
        self.interval = interval
        MF = pb_utils.MetricFamily
        kinds = {MetricKind.GAUGE: MF.GAUGE, MetricKind.COUNTER: MF.COUNTER, MetricKind.HISTOGRAM: MF.HISTOGRAM}
        # Keep a reference to every family and metric: Triton drops a family whose Python object dies.
        self.families = {}
        self.metrics = {}
        for m in EXPORTED_METRICS:
            family = MF(name=m.name, description=m.description, kind=kinds[m.kind])
            self.families[m.name] = family
            if m.kind is MetricKind.HISTOGRAM:
                buckets = list(m.read(read_snapshot()).buckets)
                self.metrics[m.name] = family.Metric(labels=labels, buckets=buckets)
            else:
                self.metrics[m.name] = family.Metric(labels=labels)
        if cache_config is not None:  # static: set once
            family = self.families[CACHE_CONFIG_INFO] = MF(name=CACHE_CONFIG_INFO, description=CACHE_CONFIG_DESCRIPTION,
                                                           kind=MF.GAUGE)
            self.metrics[CACHE_CONFIG_INFO] = family.Metric(labels={**labels, **cache_config})
            self.metrics[CACHE_CONFIG_INFO].set(1.0)
        for counter in EXPORTED_LABELLED_COUNTERS:
            self.families[counter.name] = MF(name=counter.name, description=counter.description, kind=MF.COUNTER)
        self.read_lora_stats = read_lora_stats
        self.lora_labels: dict[str, str] | None = None
        """The labels of the one vllm:lora_requests_info sample now exported (its family is made at
        the first refresh)."""
        self.labelled: dict[tuple[str, str], object] = {}
        """(family name, label value) -> its metric, created when the value first occurs."""
        self.last: MetricsSnapshot | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.RLock()  # stop() refreshes while holding it
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedserve-metrics", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Refresh soon (a request just finished)."""
        self._wake.set()

    def stop(self) -> None:
        """Refresh one last time, then release every metric and family (the model's finalize()).

        The stub deletes each through a message to Triton, which works only while it still
        serves the model. Left to the interpreter's teardown, they were deleted after that channel
        was gone: the stub segfaulted in Metric::SaveToSharedMemory on every unload, silently or,
        once a structured-output request had run, with a crash report Triton's exit waited for."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with self._lock:
            self.refresh()
            self._closed = True
            self.labelled.clear()  # metrics before their families
            self.metrics.clear()
            self.families.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a metrics hiccup must not end the refresher
                logger.exception("pagedserve: refreshing Triton metrics failed")

    def refresh(self) -> None:
        with self._lock:
            if self._closed:
                return
            snap, last = self.read_snapshot(), self.last
            for m in EXPORTED_METRICS:
                metric, value = self.metrics[m.name], m.read(snap)
                if m.kind is MetricKind.GAUGE:
                    metric.set(float(value))
                elif m.kind is MetricKind.COUNTER:
                    delta = value - (m.read(last) if last is not None else 0)
                    if delta > 0:
                        metric.increment(float(delta))
                else:
                    for v in replay_observations(m.read(last) if last is not None else None, value):
                        metric.observe(v)
            for counter in EXPORTED_LABELLED_COUNTERS:
                before = counter.read(last) if last is not None else {}
                for value, count in counter.read(snap).items():
                    delta = count - before.get(value, 0)
                    if delta > 0:
                        key = (counter.name, value)
                        if key not in self.labelled:
                            self.labelled[key] = self.families[counter.name].Metric(
                                labels={**self.labels, counter.label: value})
                        self.labelled[key].increment(float(delta))
            if self.read_lora_stats is not None:
                self._refresh_lora_info(self.read_lora_stats())
            self.last = snap

    def _refresh_lora_info(self, stats: LoRAStats) -> None:
        """One sample whose labels are the adapters in use now, set to the current time as vLLM
        sets it. When the adapters change, the family is made anew: releasing a metric leaves its
        sample on Triton's page, releasing its family takes every sample with it. So the page
        shows the current set only, where vLLM's keeps every set it has seen (consumers take the
        newest either way; a scrape in between may find no sample)."""
        labels = {**self.labels, **lora_info_labels(stats)}
        if labels != self.lora_labels:
            MF = self.pb_utils.MetricFamily
            self.metrics.pop(LORA_INFO, None)  # the metric before its family
            self.families.pop(LORA_INFO, None)
            self.families[LORA_INFO] = MF(name=LORA_INFO, description=LORA_INFO_DESCRIPTION, kind=MF.GAUGE)
            self.metrics[LORA_INFO] = self.families[LORA_INFO].Metric(labels=labels)
            self.lora_labels = labels
        self.metrics[LORA_INFO].set(time.time())
