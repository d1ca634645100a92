"""bench/int8_weights.py runs from a clone: each side in its own process, the int8 side holding
about half of bf16's weight bytes, and the ratios printed last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.int8_weights import parse_args

ROOT = Path(__file__).resolve().parents[1]


def test_runs_both_sides_and_prints_the_ratios(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "bench.int8_weights", "--model", str(tiny_model_dir("llama3")),
                          "--sides", "bf16,int8", "--workload", "generated", "--num-requests", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    weights = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(\w+)\] weights ([\d.]+) MiB", out, re.M)}
    assert set(weights) == {"bf16", "int8"}
    # Tied embedding: every matrix int8 (plus fp32 scales and bf16 norms).
    assert 0.45 < weights["int8"] / weights["bf16"] < 0.6, weights
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\[int8 vs bf16\] batch-1 decode [\d.]+x faster, W64 [\d.]+x, weights 0\.\d\dx", last), last


def test_unknown_side_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--sides", "bf16,int4"])
    assert "unknown side 'int4'" in capsys.readouterr().err
