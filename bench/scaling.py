"""How cost grows with context and concurrency: pagedserve vs vLLM's CPU build, same run, a grid.

    python -m bench.scaling [--model DIR] [--dtype auto|bfloat16|float32] [--max-num-seqs 64]
                            [--kv-cache-memory BYTES] [--lengths 128,1024,4096,8192]
                            [--concurrency 1,8,64] [--output-len 128] [--venv bench/.peer-venv]
                            [--no-install] [--png PATH] [--sides pagedserve,vllm]

Each cell is `concurrency` requests of `prompt_len` tokens of real text (slices of the W64
prompts, a different slice per request), all arriving at once, each generating `output_len`
tokens greedily with EOS ignored; per cell the output tok/s over the cell's wall time and the
mean TTFT (time from the cell's start to a request's first token), on each side. Each side runs in
its own child process (bench/scaling_child.py); both stay loaded and take turns cell by cell (the
order flips each cell), so load from elsewhere on the machine falls on both alike; each cell
starts once the machine is idle again (vLLM's engine core keeps about one CPU busy for a second
or so after its work, which the next cell would otherwise run beside). Both get the
same KV memory (--kv-cache-memory, default 4 GiB: vLLM's VLLM_CPU_KVCACHE_SPACE), the same
max_num_seqs (default 64), chunked prefill on, prefix caching off; a cell whose KV does not fit at once queues on both sides alike.

A prompt length past what the model takes with the output (SmolLM2: 8,192 positions) is cut to
max_model_len - output_len and the table says so (8192 -> 8064 for SmolLM2).

Output: one line per cell and side as it finishes, then a markdown table (the format of
docs/benchmarks.md) with the ratio per cell, and with --png a plot of both metrics against
prompt length, one line per engine and concurrency. The vLLM side installs as in
bench/vllm_peer.py (its side virtualenv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from bench.common import W64, add_engine_flags, load_workload, refuse_engine_flags
from bench.vllm_peer import cpu_flags, ensure_vllm_venv

SIDES = ("pagedserve", "vllm")
QUIET_IDLE_SHARE = 0.9
"""Share of the CPUs idle over half a second at which a cell starts (wait_for_quiet)."""
QUIET_MAX_S = 30.0
"""Most seconds a cell waits for that; it then starts anyway, and a line before its result says so."""
CHILD_FLAGS = ("model", "dtype", "max_num_seqs", "kv_cache_memory")
"""The engine flags bench/scaling_child.py takes (the same for both sides); the others are refused."""


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(ap, model="default", dtype="auto", max_num_seqs=64, kv_cache_memory=4 * 2**30)
    ap.add_argument("--lengths", type=int_list, default=[128, 1024, 4096, 8192], help="prompt lengths")
    ap.add_argument("--concurrency", type=int_list, default=[1, 8, 64], help="requests per cell")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--venv", type=Path, default=ROOT / "bench" / ".peer-venv", help="vLLM's side virtualenv")
    ap.add_argument("--no-install", action="store_true", help="fail instead of installing vLLM")
    ap.add_argument("--sides", default=",".join(SIDES), help="which engines to run (comma-separated)")
    ap.add_argument("--png", type=Path, default=None, help="write the plot here")
    args = ap.parse_args(argv)
    refuse_engine_flags(ap, args, CHILD_FLAGS, "both sides run at bench/scaling_child.py's settings")
    args.kv_gib = args.kv_cache_memory / 2**30
    args.sides = [s for s in args.sides.split(",") if s]
    if unknown := sorted(set(args.sides) - set(SIDES)):
        ap.error(f"--sides: unknown {unknown}; choose from {list(SIDES)}")
    return args


def idle_cpus(window_s: float) -> float:
    """CPUs' worth of idle time on the CPUs this process may run on (the sides' too) over the next
    window_s seconds, as the thread governor reads it; all of them where /proc/stat is unreadable."""
    from pagedserve.core.cpu_threads import allowed_cpus
    from pagedserve.core.thread_governor import idle_cpu_seconds

    cpus = allowed_cpus()
    idle0, start = idle_cpu_seconds(cpus), time.monotonic()
    time.sleep(window_s)
    idle1 = idle_cpu_seconds(cpus)
    if idle0 is None or idle1 is None:
        return float(len(cpus))
    return (idle1 - idle0) / (time.monotonic() - start)


def wait_for_quiet(max_s: float = QUIET_MAX_S) -> float:
    """Waits until the machine is idle (QUIET_IDLE_SHARE of its CPUs over a 0.5 s window), at most
    max_s; returns the seconds waited. Why: the side that just ran a cell keeps CPUs busy after it
    (vLLM's idle engine core polls at about one CPU for a second or more), and a cell started then
    runs beside a neighbour (pagedserve's first token measured 0.44 s instead of 0.04 at 128 x 1,
    its thread governor giving up a thread for the neighbour)."""
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        if idle_cpus(0.5) >= QUIET_IDLE_SHARE * len(os.sched_getaffinity(0)):
            break
    return time.monotonic() - start


def model_limit(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    return int(config.get("max_position_embeddings") or 2048)


def token_pool(tokenizer, needed: int) -> list[int]:
    """The W64 prompts' ids end to end, repeated until there are `needed` of them."""
    ids = [t for r in load_workload(W64, tokenizer, verbose=False).requests for t in r.prompt_ids]
    return (ids * (needed // len(ids) + 1))[:needed]


class Side:
    """One engine's child process (bench/scaling_child.py), loaded once, running cells on demand."""

    def __init__(self, name: str, python: Path, args: argparse.Namespace, model: str, dtype: str,
                 pool_file: Path, max_model_len: int) -> None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
               "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_gib:g}", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [str(python), str(ROOT / "bench" / "scaling_child.py"), "--side", name, "--model", model,
               "--dtype", dtype, "--pool", str(pool_file), "--max-num-seqs", str(args.max_num_seqs),
               "--max-model-len", str(max_model_len), "--kv-gib", str(args.kv_gib)]
        self.name, self.tail = name, []
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self._read_until("READY")

    def _read_until(self, prefix: str) -> str:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-25:]
            if line.startswith(prefix):
                return line[len(prefix):]
        raise RuntimeError(f"the {self.name} side exited with {self.proc.wait()}:\n{''.join(self.tail)}")

    def run(self, cell: dict) -> dict:
        self.proc.stdin.write(json.dumps(cell) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self._read_until("CELL "))
        print(f"[{self.name}] prompt {result['prompt_len']:>5} x {result['concurrency']:>2}: "
              f"{result['output_tok_s']:8.1f} output tok/s, TTFT mean {result['ttft_mean_s']:.3f} s "
              f"(wall {result['wall_s']:.1f} s)", flush=True)
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def table(results: dict[str, list[dict]], cut: dict[int, int]) -> str:
    """Markdown rows per cell: each side's output tok/s and mean TTFT, and the tok/s ratio."""
    ours, peer = results.get("pagedserve", []), results.get("vllm", [])
    asked_for = {v: k for k, v in cut.items()}
    rows = ["| prompt | conc. | pagedserve tok/s | vLLM tok/s | ratio | pagedserve TTFT s | vLLM TTFT s |",
            "|---|---|---|---|---|---|---|"]
    for i, cell in enumerate(ours or peer):
        a, b = (side[i] if i < len(side) else None for side in (ours, peer))
        length, asked = cell["prompt_len"], asked_for.get(cell["prompt_len"], cell["prompt_len"])
        shown = f"{asked} (cut to {length})" if asked != length else str(length)
        ratio = f"{a['output_tok_s'] / b['output_tok_s']:.2f}x" if a and b else "-"
        tok_s = [f"{s['output_tok_s']:.1f}" if s else "-" for s in (a, b)]
        ttft = [f"{s['ttft_mean_s']:.3f}" if s else "-" for s in (a, b)]
        rows.append(f"| {shown} | {cell['concurrency']} | {tok_s[0]} | {tok_s[1]} | {ratio} | {ttft[0]} | {ttft[1]} |")
    return "\n".join(rows)


def plot(results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side, cells in results.items():
        style = "-" if side == "pagedserve" else "--"
        for color, conc in enumerate(sorted({c["concurrency"] for c in cells})):
            row = [c for c in cells if c["concurrency"] == conc]
            x = [c["prompt_len"] for c in row]
            for ax, key in ((left, "output_tok_s"), (right, "ttft_mean_s")):
                ax.plot(x, [c[key] for c in row], style, color=f"C{color}", marker="o", label=f"{side} c={conc}")
    for ax, what in ((left, "output tok/s"), (right, "mean TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from pagedserve.core.engine import resolve_dtype
    from pagedserve.core.models.default_model import resolve_model_path

    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    model = str(resolve_model_path(args.model))
    max_model_len = min(model_limit(model), max(args.lengths) + args.output_len)
    cut = {n: min(n, max_model_len - args.output_len) for n in args.lengths}
    cells = [{"prompt_len": cut[n], "concurrency": c, "output_len": args.output_len}
             for n in args.lengths for c in args.concurrency]
    flags = cpu_flags()
    print(f"[env] cpu flags: {flags}; {os.cpu_count()} cores; dtype {dtype}; KV {args.kv_gib:g} GiB per side; "
          f"max_model_len {max_model_len}")
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    results: dict[str, list[dict]] = {side: [] for side in args.sides}
    sides: list[Side] = []
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        pool_file = Path(tmp) / "pool.json"
        pool_file.write_text(json.dumps(token_pool(tokenizer, max(cut.values()) + 997 * max(args.concurrency) + 1)))
        try:
            for name in args.sides:
                python = Path(sys.executable)
                if name == "vllm":
                    try:
                        python = ensure_vllm_venv(args.venv, install=not args.no_install)
                    except (RuntimeError, subprocess.CalledProcessError) as exc:
                        print(f"[vllm] not run: vLLM could not be installed here ({exc})")
                        del results[name]
                        continue
                sides.append(Side(name, python, args, model, dtype, pool_file, max_model_len))
            # Both engines stay loaded and take turns per cell (the order flips every cell), so a
            # neighbour's load on this machine falls on both sides of a ratio alike.
            # Each cell starts on an idle machine (wait_for_quiet).
            for i, cell in enumerate(cells):
                for side in sides[::-1] if i % 2 else sides:
                    if wait_for_quiet() >= QUIET_MAX_S:
                        print(f"[{side.name}] the machine stayed busy for {QUIET_MAX_S:.0f} s: this cell ran beside "
                              "that load", flush=True)
                    results[side.name].append(side.run(cell))
        finally:
            for side in sides:
                side.close()
    print(f"\n{dtype}, cpu flags {flags}, output {args.output_len} tokens, greedy:\n")
    print(table(results, cut))
    if args.png:
        plot(results, args.png, f"pagedserve (solid) vs vLLM CPU (dashed), {dtype}, {flags}")
        print(f"\n[png] {args.png}")


if __name__ == "__main__":
    main()
