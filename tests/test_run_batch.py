"""`pagedserve run-batch` (issue 17): OpenAI Batch files, per-line errors, resume, progress.

Good lines are checked against transformers' greedy generate (the oracle), bad lines against the
error each one must name; resume against a half-written output with a torn last line.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.tools.run_batch import main as run_batch_main
from pagedserve.tools.run_batch import run_batch
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine

from tests.oracle import hf_greedy


def completion_line(custom_id, prompt, max_tokens=6, **extra):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}}


def write_jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))


def read_records(path) -> dict:
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    return recs


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    path = tiny_model_dir("llama")
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", "device": "cpu",
                                             "max_model_len": 64, "scheduling_policy": "throughput"}))


def expected_text(engine, prompt_ids, n):
    return engine.tokenizer.decode(hf_greedy(engine.model_path, prompt_ids, n), skip_special_tokens=True)


def test_good_lines_match_transformers_and_bad_lines_get_their_own_error(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = {"a": [5, 17, 33, 90, 4], "b": [100, 3, 250], "c": [7, 7, 8, 9, 10, 11]}
    write_jsonl(inp, [
        completion_line("a", good["a"]),
        "{this is not json",
        {"method": "POST", "url": "/v1/completions", "body": {}},                      # no custom_id
        completion_line("b", good["b"]),
        {**completion_line("bad-url", [1]), "url": "/v1/embeddings"},
        completion_line("unknown-field", [1, 2], temperatur=0.5),
        completion_line("too-long", list(range(3, 70))),
        completion_line("a", [1, 2, 3]),                                               # duplicate id
        completion_line("c", good["c"], max_tokens=4),
    ])
    counts = run_batch(engine, inp, out, progress=False, max_queued=2)  # refilled as lines finish
    recs = read_records(out)
    assert len(recs) == 9 and counts["succeeded"] == 3 and counts["failed"] == 6
    by_id = {}
    for r in recs:
        by_id.setdefault(r["custom_id"], []).append(r)
    for cid, ids in good.items():
        ok = [r for r in by_id[cid] if r["response"] and r["response"]["status_code"] == 200]
        assert len(ok) == 1
        body = ok[0]["response"]["body"]
        n = 4 if cid == "c" else 6
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["choices"][0]["text"] == expected_text(engine, ids, n)
        assert body["usage"]["completion_tokens"] == n and body["usage"]["prompt_tokens"] == len(ids)
    errors = {r["id"]: r for r in recs if r["error"] is not None}
    assert "not valid JSON" in errors["batch_req_line 2"]["error"]["message"]
    assert "custom_id must be a non-empty string" in errors["batch_req_line 3"]["error"]["message"]
    assert "/v1/embeddings" in by_id["bad-url"][0]["error"]["message"]
    (dup,) = [r for r in by_id["a"] if r["error"] is not None]  # written first: it never ran
    assert dup["error"]["code"] == "invalid_batch_line" and "duplicate custom_id" in dup["error"]["message"]
    resp = by_id["unknown-field"][0]["response"]
    assert resp["status_code"] == 400 and "temperatur" in resp["body"]["error"]["message"]
    resp = by_id["too-long"][0]["response"]
    assert resp["status_code"] == 400 and resp["body"]["error"]["code"] == "context_length_exceeded"
    assert not engine.has_unfinished_requests()


def test_rerun_skips_answered_lines_and_cuts_a_torn_last_line(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = {f"q{i}": [10 + i, 20 + i, 30 + i] for i in range(4)}
    write_jsonl(inp, [completion_line(cid, p) for cid, p in prompts.items()] + ["not json"])
    first = run_batch(engine, inp, out, progress=False)
    assert first["succeeded"] == 4 and first["failed"] == 1
    full = out.read_text().splitlines()
    # a run killed after two results, in the middle of writing the third
    kept = [ln for ln in full if json.loads(ln)["custom_id"] in ("q0", "q2")]
    out.write_text("\n".join(kept) + "\n" + full[-1][: len(full[-1]) // 2])
    second = run_batch(engine, inp, out, progress=False)
    assert second["skipped"] == 2 and second["succeeded"] == 2 and second["failed"] == 1
    recs = read_records(out)
    ids = sorted(r["custom_id"] or r["id"] for r in recs)
    assert second["output_tokens"] == 2 * 6  # only the two missing lines ran
    assert ids == ["batch_req_line 5", "q0", "q1", "q2", "q3"]  # one record each, torn line gone
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in recs if r["custom_id"]}
    for cid, p in prompts.items():
        assert texts[cid] == expected_text(engine, p, 6)
    third = run_batch(engine, inp, out, progress=False)  # nothing left to do
    assert third["skipped"] == 5 and third["succeeded"] == third["failed"] == 0


def test_n_samples_and_several_prompts_in_one_line_make_one_result(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [completion_line("multi", [[5, 6, 7], [8, 9]], max_tokens=3, n=2, temperature=0.8, seed=1)])
    run_batch(engine, inp, out, progress=False)
    (rec,) = read_records(out)
    body = rec["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] == 5


def test_cache_salt_lines_share_cached_blocks_only_under_the_same_salt(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompt = [(i * 37) % 380 + 3 for i in range(40)]  # 2 full blocks of 16 can be cached
    write_jsonl(inp, [completion_line("a1", prompt, cache_salt="a"), completion_line("b1", prompt, cache_salt="b"),
                      completion_line("a2", prompt, cache_salt="a"), completion_line("none", prompt),
                      completion_line("empty", prompt, cache_salt="")])
    run_batch(engine, inp, out, progress=False, max_queued=1)  # one line at a time, in order
    recs = {r["custom_id"]: r["response"] for r in read_records(out)}
    cached = {cid: recs[cid]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
              for cid in ("a1", "b1", "a2", "none")}
    assert cached == {"a1": 0, "b1": 0, "a2": 32, "none": 0}
    assert recs["empty"]["status_code"] == 400 and recs["empty"]["body"]["error"]["param"] == "cache_salt"


def test_cli_reports_progress_with_tokens_per_second(tiny_model_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [completion_line(f"r{i}", [3 + i, 4, 5]) for i in range(3)])
    rc = run_batch_main(["-i", str(inp), "-o", str(out), "--model", str(tiny_model_dir("llama")),
                         "--dtype", "float32", "--max-model-len", "64"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "tok/s" in captured.err and "run-batch" in captured.err  # the progress bar
    assert "3 lines: 3 succeeded, 0 failed, 0 already in" in captured.out
    assert len(read_records(out)) == 3


def test_cli_runs_with_the_throughput_policy_unless_told_otherwise(tmp_path):
    from pagedserve.tools.run_batch import batch_engine_config, build_parser

    assert batch_engine_config(build_parser().parse_args(["-i", "x", "-o", "y"])).scheduler.scheduling_policy \
        == "throughput"
    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps({"scheduling_policy": "prefix"}))
    args = build_parser().parse_args(["-i", "x", "-o", "y", "--engine-config", str(cfg)])
    assert batch_engine_config(args).scheduler.scheduling_policy == "prefix"
    args = build_parser().parse_args(["-i", "x", "-o", "y", "--scheduling-policy", "fcfs"])
    assert batch_engine_config(args).scheduler.scheduling_policy == "fcfs"


def test_cli_batch_defaults_fill_only_what_the_engine_config_leaves_out(tmp_path):
    from pagedserve.tools.run_batch import BATCH_DEFAULTS, batch_engine_config, build_parser

    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps({"scheduling_age_bound_s": 5.0, "max_num_seqs": 3}))
    args = build_parser().parse_args(["-i", "x", "-o", "y", "--engine-config", str(cfg), "--max-num-seqs", "7"])
    scheduler = batch_engine_config(args).scheduler
    assert scheduler.scheduling_age_bound_s == 5.0  # the file's, not the batch default
    assert scheduler.scheduling_policy == BATCH_DEFAULTS["scheduling_policy"]  # the file left it out
    assert scheduler.max_num_seqs == 7  # the flag over the file


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"),
                                           ("[1, 2]", "expected a JSON object, got list")])
def test_cli_a_bad_engine_config_is_one_clear_error(tmp_path, capsys, text, message):
    inp, cfg = tmp_path / "in.jsonl", tmp_path / "engine.json"
    write_jsonl(inp, [completion_line("r0", [3, 4, 5])])
    cfg.write_text(text)
    assert run_batch_main(["-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--engine-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("pagedserve run-batch: error:") == 1 and str(cfg) in err and message in err


CITY_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}


@pytest.mark.slow
def test_chat_lines_on_the_default_model_from_the_pagedserve_command(tmp_path):
    import subprocess
    import sys

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "SmolLM2", "messages": [{"role": "user", "content": "Name three primary colors."}],
                  "max_tokens": 24, "temperature": 0}},
        {"custom_id": "chat-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "SmolLM2", "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]}},
        {"custom_id": "chat-3", "method": "POST", "url": "/v1/chat/completions",  # a forced call, as the server
         "body": {"model": "SmolLM2", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                  "tools": [CITY_TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}},
                  "max_tokens": 40, "temperature": 0}},
    ])
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tools.cli", "run-batch", "-i", str(inp), "-o", str(out),
                           "--model", "default", "--max-model-len", "512", "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    recs = {r["custom_id"]: r for r in read_records(out)}
    body = recs["chat-1"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    text = body["choices"][0]["message"]["content"].lower()
    assert sum(c in text for c in ("red", "blue", "yellow", "green")) >= 2
    assert recs["chat-2"]["response"]["status_code"] == 400
    assert "tools" in recs["chat-2"]["response"]["body"]["error"]["message"]
    (call,) = recs["chat-3"]["response"]["body"]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY_TOOL["function"]["parameters"])
