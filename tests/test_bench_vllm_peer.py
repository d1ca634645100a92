"""bench/vllm_peer.py without vLLM: the pagedserve side still runs in its child process and the
last line says the ratio was not measured here (never a made-up ratio)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_peer_bench(tiny_model_dir, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [{"prompt_ids": [5, 9, 33, 2, 71], "max_new_tokens": 6},
                                                 {"prompt_ids": list(range(40, 70)), "max_new_tokens": 3}]}))
    return subprocess.run(  # as the docs run it: a module, from the checkout root
        [sys.executable, "-m", "bench.vllm_peer", "--model", str(tiny_model_dir("llama")),
         "--dtype", "float32", "--workload", str(workload), "--venv", str(tmp_path / "no-venv"), "--no-install",
         *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_without_vllm_reports_pagedserve_and_no_ratio(tiny_model_dir, tmp_path):
    out = run_peer_bench(tiny_model_dir, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    ours = next(line for line in lines if line.startswith("[pagedserve]"))
    assert "(9 useful output tokens)" in ours and "dtype=float32" in ours and "peak_rss=" in ours
    assert "decode_b1 ms/token=" in ours and "prefill_512 tok/s=" in ours
    assert "without --no-install" in out.stdout  # says why there is no peer and how to get one
    assert lines[-1].startswith("ratio pagedserve/vllm (float32): not measured here")
    assert "from another host" in lines[-1]


def test_rounds_run_each_side_again_and_say_what_is_compared(tiny_model_dir, tmp_path):
    out = run_peer_bench(tiny_model_dir, tmp_path, "--rounds", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    runs = [line for line in lines if line.startswith("[pagedserve]")]
    assert len(runs) == 2 and all("(9 useful output tokens)" in line for line in runs)
    walls = [float(line.split("wall ")[1].split("s,")[0]) for line in runs]
    summary = next(line for line in lines if line.startswith("[rounds] pagedserve:"))
    assert summary.startswith(f"[rounds] pagedserve: wall {walls[0]:.2f}, {walls[1]:.2f} s")
    assert lines[-1].startswith("ratio pagedserve/vllm (float32): not measured here")


def test_rounds_must_be_positive():
    out = subprocess.run([sys.executable, "-m", "bench.vllm_peer", "--rounds", "0"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "--rounds must be at least 1, got 0" in out.stderr


def test_tree_rss_counts_children():
    """The peak RSS vllm_peer.py reports is bench/proctree.tree_rss of each side's child tree."""
    from bench.proctree import tree_rss

    def tree_rss_bytes(pid: int) -> int:
        return tree_rss(pid)[0]

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); time.sleep(30)"])
    try:
        import time
        deadline = time.time() + 20
        while tree_rss_bytes(child.pid) < 150 << 20:  # the child's bytearray is resident once written
            assert time.time() < deadline, "the child's 200 MiB never showed up"
            time.sleep(0.1)
        # This process (torch imported: well over 10 MiB) plus the child.
        assert tree_rss_bytes(os.getpid()) >= tree_rss_bytes(child.pid) + (10 << 20)
    finally:
        child.kill()
        child.wait()


def test_memory_breakdown_finds_a_lazily_touched_pool():
    """bench/startup.py --breakdown: an engine's KV pool (one large private mapping, resident only
    where written) is told apart from the rest of the process."""
    from bench.proctree import memory_breakdown

    code = ("import mmap, sys, time\n"
            "pool = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
            "for offset in range(0, 96 << 20, 4096): pool[offset] = 1  # 96 MiB of it used\n"
            "other = bytearray(40 << 20)\n"
            "print('ready', flush=True); time.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        parts = memory_breakdown(child.pid)
        mib = 1 << 20
        pool = parts["anon >= 1 GiB"]
        assert pool >= 96 * mib and parts["files (libraries)"] > 0, parts
        # The bytearray is mmapped by malloc: beside the pool (the kernel then merges the two
        # mappings) or elsewhere.
        rest = sum(v for k, v in parts.items() if k != "files (libraries)")
        assert rest >= 136 * mib and pool < 140 * mib, parts
        with open(f"/proc/{child.pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        assert abs(sum(parts.values()) - rss) < 4 * mib  # every resident page is in one part
    finally:
        child.kill()
        child.wait()
    assert memory_breakdown(child.pid) == {}  # gone
