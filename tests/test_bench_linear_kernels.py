"""bench/linear_kernels.py runs from a clone and times torch and every kernel that runs here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from bench.linear_kernels import KERNELS
from pagedserve.kernels.cpu import linear as cpu_linear

ROOT = Path(__file__).resolve().parents[1]


def test_times_torch_and_each_runnable_kernel_and_names_the_pick():
    out = subprocess.run([sys.executable, "-m", "bench.linear_kernels", "--dtype", "bfloat16", "--rows", "3",
                          "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    timed = [line.split()[3].lstrip("*") for line in out.splitlines() if line.startswith("bfloat16") and " ms " in line]
    runnable = cpu_linear.runnable_kernels(torch.bfloat16)
    assert timed == ["torch"] + [name for name, kernel in KERNELS.items() if kernel in runnable]
    picked = cpu_linear.prepack_linear(torch.zeros(960, 576, dtype=torch.bfloat16))
    pick = "torch" if picked is None else next(n for n, k in KERNELS.items() if k is picked.kernel)
    assert sum(line.split()[3] == f"*{pick}" for line in out.splitlines()) == 1
    assert f"picked {pick}:" in out.splitlines()[-1]
