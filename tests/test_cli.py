"""The pagedserve command line: generate on a local model, clear errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedserve.tools.cli import main

from tests.oracle import hf_greedy


def test_generate_prints_the_greedy_continuation(tiny_model_dir, capsys):
    path = tiny_model_dir("llama")
    rc = main(["generate", "--model", str(path), "--dtype", "float32", "--raw", "--prompt", "The paged KV cache",
               "--max-tokens", "12"])
    assert rc == 0
    out = capsys.readouterr().out
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = tok.encode("The paged KV cache")
    expected = tok.decode(hf_greedy(path, prompt_ids, 12), skip_special_tokens=True).strip()
    assert f"### The paged KV cache\n{expected}\n" in out
    assert "1 requests, " in out and "tokens/s" in out


def test_engine_config_file_and_bad_key(tiny_model_dir, tmp_path, capsys):
    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps({"model": str(tiny_model_dir("llama")), "dtype": "float32", "block_sizes": 8}))
    rc = main(["generate", "--engine-config", str(cfg), "--raw", "--prompt", "hi"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown key(s) 'block_sizes'" in err and "block_size" in err


def test_engine_config_file_errors_name_the_file_and_flags_override_it(tiny_model_dir, tmp_path, capsys):
    from pagedserve.tools.cli import build_parser
    from pagedserve.tools.engine_args import engine_config_from_args

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["generate", "--engine-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not valid JSON" in err and "Traceback" not in err

    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps({"model": str(tiny_model_dir("llama")), "max_model_len": 512, "max_num_seqs": 8}))
    args = build_parser().parse_args(["generate", "--engine-config", str(cfg), "--max-model-len", "256"])
    config = engine_config_from_args(args)
    assert config.model.max_model_len == 256 and config.scheduler.max_num_seqs == 8


def test_missing_model_path_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tools.cli", "generate", "--model",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert str(tmp_path / "nope") in proc.stderr and "Traceback" not in proc.stderr
