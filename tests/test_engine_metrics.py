"""The shared metric table both adapters export: names, kinds and histogram exposition."""

from pagedserve.adapters.engine_metrics import (ENGINE_METRICS, LABELLED_COUNTERS, REQUEST_SUCCESS, VLLM_LABELLED_COUNTERS,
                                                VLLM_METRICS, MetricKind, cache_config_labels, cumulative_buckets)
from pagedserve.core.async_engine import ModelInfo
from pagedserve.core.metrics import EngineMetrics

ISSUE_NAMES = {
    "pagedserve:num_requests_running", "pagedserve:num_requests_waiting", "pagedserve:kv_cache_usage_perc",
    "pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total",
    "pagedserve:num_preemptions_total", "pagedserve:prompt_tokens_total",
    "pagedserve:generation_tokens_total", "pagedserve:time_to_first_token_seconds",
    "pagedserve:inter_token_latency_seconds", "pagedserve:e2e_request_latency_seconds",
    "pagedserve:engine_step_failures_total",
}


def test_every_promised_metric_is_exported_once():
    names = [m.name for m in ENGINE_METRICS]
    assert set(names) == ISSUE_NAMES and len(names) == len(ISSUE_NAMES)
    for m in ENGINE_METRICS:
        assert m.name.endswith("_total") == (m.kind is MetricKind.COUNTER), m.name
    assert [c.name for c in LABELLED_COUNTERS] == ["pagedserve:request_success_total",
                                                   "pagedserve:request_refused_total"]


def test_read_values_from_a_snapshot():
    metrics = EngineMetrics()
    for v in (0.001, 0.003, 0.005, 100.0, 5000.0):  # on a bound, inside, overflow
        metrics.observe_first_token(v)
    metrics.observe_finished("stop", 1.0)
    metrics.observe_finished("length", 2.0)
    metrics.observe_refused("waiting_requests")
    metrics.observe_step_failure()
    snap = metrics.snapshot()
    by_name = {m.name: m for m in ENGINE_METRICS}
    ttft = by_name["pagedserve:time_to_first_token_seconds"].read(snap)
    buckets = dict(cumulative_buckets(ttft))
    assert buckets[0.001] == 1  # Prometheus `le`: a value on the bound counts in that bucket
    assert buckets[0.005] == 3
    assert buckets[640.0] == 4
    assert buckets[float("inf")] == 5 == ttft.count
    assert abs(ttft.sum - 5100.009) < 1e-9
    assert REQUEST_SUCCESS.read(snap) == {"stop": 1, "length": 1}
    assert LABELLED_COUNTERS[1].read(snap) == {"waiting_requests": 1}
    assert by_name["pagedserve:engine_step_failures_total"].read(snap) == 1
    assert by_name["pagedserve:prompt_tokens_total"].base_name == "pagedserve:prompt_tokens"


VLLM_NAMES = {  # what vLLM's own servers export (vllm/v1/metrics/loggers.py), as routers and KEDA read them
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
}


def test_vllms_names_twin_every_family_vllm_has():
    assert {m.name for m in VLLM_METRICS} == VLLM_NAMES
    assert [c.name for c in VLLM_LABELLED_COUNTERS] == ["vllm:request_success_total"]
    assert VLLM_LABELLED_COUNTERS[0].label == "finished_reason"
    twins = {m.name: m for m in ENGINE_METRICS}
    metrics = EngineMetrics()
    metrics.observe_finished("stop", 0.5)
    snap = metrics.snapshot()
    for m in VLLM_METRICS:  # the same reading, the same kind, under the other name
        twin = twins[m.name.replace("vllm:", "pagedserve:")]
        assert (m.kind, m.read(snap)) == (twin.kind, twin.read(snap))


def test_cache_config_info_labels_are_vllms():
    info = ModelInfo("m", 128, 384, 1000, False, block_size=16, num_kv_blocks=512, kv_cache_dtype="auto",
                     enable_prefix_caching=True)
    assert cache_config_labels(info) == {"block_size": "16", "num_gpu_blocks": "512", "cache_dtype": "auto",
                                         "enable_prefix_caching": "True"}
