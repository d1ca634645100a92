"""Weight-only int8 (`quantization: int8`) against bf16 and fp32 weights, in one invocation.

    python -m bench.int8_weights [--sides bf16,int8,fp32,int8_fp32] [--rounds N] [--workload PATH]
                                 [--num-requests N] [engine flags, e.g. --model DIR]

Each side runs in its own child process (so its RSS is its own), after one child that makes sure the
model's int8 calibration is cached (its first int8 start runs it: core/models/int8_calibration.py): dtype
and quantization
  bf16 = bfloat16, none;  int8 = bfloat16, int8;  fp32 = float32, none;  int8_fp32 = float32, int8
and reports:
* weight MiB: the bytes the model's weights hold after load (packed copies, int8 codes and their
  scales, embedding, norms), and the process RSS after load;
* batch-1 decode ms/token: a 128-token prompt decoded for 1 and 65 tokens, (65 - 1) / 64, best of 3
  (bench/vllm_child.py's latencies(), the figure bench/vllm_peer.py reports);
* W64 output tok/s: the reference workload (bench/common.py) through LLMEngine.generate, as
  bench/throughput.py runs it.
With --rounds N the sides run N times, in order and then reversed (ABBA), and each side's best
figures count (a neighbour's burst slows one run, never speeds one up). The last lines give int8 / bf16 (and int8_fp32 / fp32) for each figure: decode speed-up (>1 is
faster), W64 ratio, weight-bytes ratio. Run it through /tmp/benchhi.sh on a shared host, and compare
only figures from the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SIDES = {"bf16": ("bfloat16", None), "int8": ("bfloat16", "int8"), "fp32": ("float32", None),
         "int8_fp32": ("float32", "int8")}


def weight_bytes(model) -> int:
    """Bytes the decoder's weights hold, whichever form each Linear keeps (core/layers/linear.py)."""
    from pagedserve.core.layers.linear import Linear

    def linear_bytes(layer: Linear) -> int:
        k = layer.kernel
        if k is not None:
            if hasattr(k, "nbytes"):
                return int(k.nbytes)
            return k.packed.numel() * k.packed.element_size()
        t = layer.packed if layer.packed is not None else layer.weight
        return t.numel() * t.element_size()

    total = sum(linear_bytes(h) for h in model.lm_head)
    for layer in model.layers:
        total += sum(linear_bytes(getattr(layer, n)) for n in ("qkv", "o", "gate_up", "down"))
        total += sum(t.numel() * t.element_size() for t in (layer.input_norm, layer.post_norm, layer.q_norm,
                                                             layer.k_norm, layer.pre_ff_norm, layer.post_ff_norm)
                     if t is not None)
    if model.embed is not None and not any(model.embed is getattr(h, "weight", None) for h in model.lm_head):
        total += model.embed.numel() * model.embed.element_size()
    return total + model.norm.numel() * model.norm.element_size()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_side(args: argparse.Namespace) -> dict:
    from bench.common import load_workload
    from bench.throughput import run_pagedserve
    from bench.vllm_child import latencies
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams
    from pagedserve.tools.engine_args import engine_config_from_args

    if args.side == "calibrate":  # the int8 sides' first start: calibrates and caches (int8_calibration.py)
        engine = LLMEngine(engine_config_from_args(args).replace(dtype="bfloat16", quantization="int8"))
        return {"side": "calibrate", "seconds": engine.load_seconds.get("int8 calibration", 0.0)
                + engine.load_seconds.get("weights", 0.0)}
    dtype, quantization = SIDES[args.side]
    engine = LLMEngine(engine_config_from_args(args).replace(dtype=dtype, quantization=quantization))
    weights, rss = weight_bytes(engine.runner.model), rss_bytes()
    workload = load_workload(args.workload, engine.tokenizer, verbose=False).head(args.num_requests)
    requests = [{"prompt_ids": r.prompt_ids} for r in workload.requests]

    def generate_one(prompt: list[int], max_tokens: int) -> None:
        engine.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)])

    generate_one(requests[0]["prompt_ids"][:16], 8)  # warm-up
    lat = latencies(generate_one, requests)
    result, _ = run_pagedserve(engine, workload)
    return {"side": args.side, "weight_mib": weights / 2**20, "rss_mib": rss / 2**20,
            "decode_b1_ms": lat["decode_b1_ms"], "w64_tok_s": result.output_tokens / result.wall_s,
            "w64_s": result.wall_s}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.common import add_engine_flags, add_workload_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    add_engine_flags(ap, model="default")
    ap.add_argument("--sides", default="bf16,int8,fp32,int8_fp32", help=f"comma-separated, of {list(SIDES)}")
    ap.add_argument("--rounds", type=int, default=1, help="runs per side, alternating the order; best counts")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # one side, in a child process
    args = ap.parse_args(argv)
    for side in args.sides.split(","):
        if side not in SIDES:
            ap.error(f"--sides: unknown side {side!r}; use {list(SIDES)}")
    return args


def child(argv: list[str], side: str) -> dict:
    """One side's figures, from a child process of its own."""
    out = subprocess.run([sys.executable, "-m", "bench.int8_weights", *argv, "--side", side],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.side:
        print("RESULT " + json.dumps(run_side(args)), flush=True)
        return
    from bench.common import environment_line

    print(environment_line())
    with open("/proc/loadavg") as f:
        print(f"[host] load average {f.read().split()[0]}")
    runs: dict[str, list[dict]] = {}
    sides = args.sides.split(",")
    if any(SIDES[side][1] == "int8" for side in sides):
        # Before any measured start: the first int8 start of a model runs its calibration (then
        # cached), which would weigh on that side's load and RSS.
        r = child(argv, "calibrate")
        print(f"[int8] calibration run + quantization (cached after the first start): {r['seconds']:.1f} s", flush=True)
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            r = child(argv, side)
            runs.setdefault(side, []).append(r)
            print(f"[{side}] weights {r['weight_mib']:.1f} MiB, RSS after load {r['rss_mib']:.0f} MiB, batch-1 decode "
                  f"{r['decode_b1_ms']:.2f} ms/token, W64 {r['w64_tok_s']:.1f} output tok/s ({r['w64_s']:.2f} s)",
                  flush=True)
    results = {side: {"weight_mib": rs[0]["weight_mib"], "decode_b1_ms": min(r["decode_b1_ms"] for r in rs),
                      "w64_tok_s": max(r["w64_tok_s"] for r in rs)} for side, rs in runs.items()}
    if args.rounds > 1:
        for side, r in results.items():
            print(f"[{side}, best of {args.rounds}] batch-1 decode {r['decode_b1_ms']:.2f} ms/token, "
                  f"W64 {r['w64_tok_s']:.1f} output tok/s")
    for quant, base in (("int8", "bf16"), ("int8_fp32", "fp32")):
        if quant in results and base in results:
            q, b = results[quant], results[base]
            print(f"[{quant} vs {base}] batch-1 decode {b['decode_b1_ms'] / q['decode_b1_ms']:.2f}x faster, "
                  f"W64 {q['w64_tok_s'] / b['w64_tok_s']:.2f}x, weights {q['weight_mib'] / b['weight_mib']:.2f}x")


if __name__ == "__main__":
    main()
