"""`pagedserve tune` and the workload recorder (issue 17).

The search is checked on a synthetic measurement surface (deterministic), the whole command on a
tiny model with an SLO set from a measurement in the same run (so machine speed cancels out), and
the recorder by replaying what an engine wrote.
"""

from __future__ import annotations

import json

import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import ConfigError
from pagedserve.tools.replay import ReplayResult, percentile
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.tools.tuner import LADDERS, Limit, Slo, best_trial, main, make_measure, search
from pagedserve.core.workload import load_workload


def result(tps: float, ttft: float, itl: float = 0.01) -> ReplayResult:
    return ReplayResult(10, 100, 100 / tps, ttft, ttft, itl, itl, 0.5, 0.4, 0)


def surface(settings):
    """Throughput grows with both limits; TTFT p95 grows with the token budget (big prefill
    chunks stall decodes), ITL with max_num_seqs. fcfs is the better policy here."""
    seqs, budget = settings["max_num_seqs"], settings["max_num_batched_tokens"]
    policy_gain = {"fcfs": 1.0, "prefix": 0.95, "throughput": 0.9}[settings["scheduling_policy"]]
    tps = policy_gain * min(seqs, 64) * (1 + budget / 4096)
    return result(tps, ttft=budget / 1000, itl=seqs / 1000)


def test_search_finds_the_best_setting_that_meets_the_slo_without_a_full_grid():
    calls = []

    def measure(settings):
        calls.append(dict(settings))
        return surface(settings)

    start = {"max_num_batched_tokens": 1024, "max_num_seqs": 128, "scheduling_policy": "fcfs"}
    slo = Slo(ttft_p95_s=0.6, itl_p95_s=0.05)  # budget <= 512 and max_num_seqs <= 32 meet it
    trials = search(measure, start, slo, max_trials=12)
    best = best_trial(trials)
    grid = 1
    for ladder in LADDERS.values():
        grid *= len(ladder)
    assert len(calls) == len(trials) <= 12 < grid
    assert len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls)  # nothing measured twice
    assert not trials[0].meets_slo  # the start misses: the search walked to the SLO
    assert best is not None and best.meets_slo
    # the best point meeting the SLO on this surface
    assert best.settings == {"max_num_batched_tokens": 512, "max_num_seqs": 32, "scheduling_policy": "fcfs"}


def test_search_reports_none_when_nothing_meets_the_slo():
    trials = search(surface, {"max_num_batched_tokens": 1024, "max_num_seqs": 128, "scheduling_policy": "fcfs"},
                    Slo(ttft_p95_s=1e-6), max_trials=5)
    assert len(trials) == 5 and best_trial(trials) is None


def test_percentile_is_nearest_rank():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([7.0], 95) == 7.0 and percentile([], 95) == 0.0


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tune_picks_a_setting_that_meets_the_slo_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    """32 long prompts arrive at once. From a 16-token step budget they queue for ~240 steps; the
    SLO is a third of that start's TTFT p95 as the tuner itself measures it in the same run
    (`--ttft-p95 0.33x`), so a host that is slower or busier than another moves the start and the
    limit together."""
    model = str(tiny_model_dir("llama"))
    workload = tmp_path / "w.jsonl"
    write_jsonl(workload, [{"arrival_time": 0.0, "prompt_tokens": 120, "output_tokens": 4} for _ in range(32)])
    out, png = tmp_path / "tuned.json", tmp_path / "tune.png"
    rc = main(["--workload", str(workload), "--ttft-p95", "0.33x", "--model", model, "--dtype", "float32",
               "--max-model-len", "256", "--max-num-batched-tokens", "16", "--max-num-seqs", "32",
               "--max-trials", "6", "--output", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "SLO TTFT p95 <= 0.33x the start's" in printed and "SLO from the start's measurement" in printed
    assert "<- best" in printed and "missed" in printed  # the start (row 0) missed the SLO
    tuned = EngineConfig.from_json_file(out)  # loadable as --engine-config / Triton engine.json
    assert tuned.scheduler.max_num_batched_tokens > 16
    assert tuned.model.model == model
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Independently re-measured, interleaved so that a change of host speed hits both alike, the
    # chosen setting is well inside what the start needed.
    base = EngineConfig.from_json_file(out).replace(max_num_batched_tokens=16)
    measure = make_measure(base, load_workload(workload))
    start, chosen = {k: base.to_dict()[k] for k in LADDERS}, {k: tuned.to_dict()[k] for k in LADDERS}
    starts, chosens = [], []
    for _ in range(2):
        starts.append(measure(start).ttft_p95_s)
        chosens.append(measure(chosen).ttft_p95_s)
    assert min(chosens) < min(starts) / 2, (starts, chosens)


def test_relative_limits_are_parsed_and_bad_ones_refused(tmp_path, capsys):
    assert Limit.parse("0.5") == Limit(0.5) and Limit.parse("0.25x") == Limit(0.25, relative=True)
    assert Limit(0.25, relative=True).seconds(2.0) == 0.5 and Limit(0.5).seconds(2.0) == 0.5
    workload = tmp_path / "w.jsonl"
    write_jsonl(workload, [{"arrival_time": 0.0, "prompt_tokens": 5, "output_tokens": 2}])
    for flag, value in (("--ttft-p95", "fast"), ("--ttft-p95", "0x"), ("--itl-p95", "-1")):
        args = ["--workload", str(workload), "--ttft-p95", "1", flag, value]
        assert main(args) == 2
        assert f"error: {flag}:" in capsys.readouterr().err


def test_tune_exits_1_and_writes_nothing_when_no_setting_meets_the_slo(tiny_model_dir, tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    write_jsonl(workload, [{"arrival_time": 0.01 * i, "prompt_tokens": 30, "output_tokens": 3} for i in range(4)])
    out = tmp_path / "tuned.json"
    rc = main(["--workload", str(workload), "--ttft-p95", "0.0000001", "--model", str(tiny_model_dir("llama")),
               "--dtype", "float32", "--max-model-len", "128", "--max-trials", "2", "--output", str(out),
               "--plot", ""])
    assert rc == 1 and not out.exists()
    assert "no setting tried met the SLO" in capsys.readouterr().err


def test_workload_files_are_validated_and_the_reference_format_is_read(tmp_path):
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"arrival_time": 0.0, "prompt_tokens": 5, "output_tokens": 2},
                      {"arrival_time": 1.0, "prompt_tokens": 0, "output_tokens": 2}])
    with pytest.raises(ConfigError, match=r"bad.jsonl line 2: prompt_tokens=0"):
        load_workload(bad)
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"requests": [{"prompt_ids": [5, 6, 7], "max_new_tokens": 4},
                                            {"prompt_ids": [8, 9], "max_new_tokens": 2}]}))
    items = load_workload(ref)
    assert [(i.arrival_time, i.prompt_tokens, i.output_tokens, i.prompt_ids) for i in items] == [
        (0.0, 3, 4, (5, 6, 7)), (0.0, 2, 2, (8, 9))]
    spread = load_workload(ref, arrival_rate=2.0)
    assert spread[0].arrival_time == 0.0 and spread[1].arrival_time > 0.0


def test_recorder_writes_lengths_and_arrival_times_only_and_tune_replays_them(tiny_model_dir, tmp_path):
    path = tmp_path / "recorded.jsonl"
    engine = LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), "dtype": "float32",
                                               "device": "cpu", "record_workload": str(path)}))
    prompt = "The paged KV cache hands out blocks"
    engine.generate([prompt, "Prefix caching"], [SamplingParams(max_tokens=3, ignore_eos=True),
                                                 SamplingParams(max_tokens=5, ignore_eos=True)])
    engine.generate(["batching"], SamplingParams(max_tokens=2, ignore_eos=True))
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert all(set(r) == {"arrival_time", "prompt_tokens", "output_tokens"} for r in rows)
    assert sorted(r["output_tokens"] for r in rows) == [2, 3, 5]
    assert len(engine.tokenize(prompt)) in [r["prompt_tokens"] for r in rows]
    assert "paged" not in path.read_text()
    assert min(r["arrival_time"] for r in rows) == 0.0 and max(r["arrival_time"] for r in rows) > 0.0
    items = load_workload(path)
    from pagedserve.tools.replay import replay
    res = replay(engine, items)
    assert res.num_requests == 3 and res.output_tokens == 10


def test_record_workload_reaches_both_servers_config_paths(tmp_path):
    from pagedserve.adapters.kserve.server import build_parser
    from pagedserve.adapters.triton_server.engine_config import load_engine_config
    from pagedserve.tools.engine_args import engine_config_from_args

    args = build_parser().parse_args(["--record-workload", str(tmp_path / "w.jsonl")])
    assert engine_config_from_args(args).scheduler.record_workload == str(tmp_path / "w.jsonl")
    engine_json = tmp_path / "engine.json"
    engine_json.write_text(json.dumps({"model": "default", "record_workload": "/tmp/w.jsonl"}))
    assert load_engine_config(engine_json).scheduler.record_workload == "/tmp/w.jsonl"
