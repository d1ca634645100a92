"""Multi-LoRA: the reference workload with 4 adapters spread over its requests vs the base model
alone, on the same engine, in the same run, per dtype.

    python -m bench.lora [--workload PATH] [--num-requests N] [--dtypes float32,bfloat16]
                         [--num-adapters 4] [--rank 16] [--repeats 2] [engine flags]
    python -m bench.lora --kernel-microbench [--dtypes ...] [--num-adapters 4] [--rank 16]

What is compared. Per dtype one engine starts with --enable-lora and max_loras = --num-adapters,
and loads that many random rank---rank adapters on all seven projections (q, k, v, o, gate, up,
down; written here as PEFT directories, so the benchmark needs no PEFT). The workload (bench/common.py;
w64.json by default, greedy, EOS ignored) runs alternately (--repeats times each, base first):
every request on the base model, then request i on adapter i mod N. Both take the same steps (the
same tokens are scheduled alike), so the ratio is the cost of the LoRA path alone; each side's
fastest run counts, so a burst of load on a shared host hits one run, not the ratio.

Output per dtype: each run's wall time and output tok/s and steps, the time spent in the LoRA
kernel (lora_add, timed around every call) per step, and `ratio lora/base: X.XXx` (target >= 0.85).

--kernel-microbench: the CPU backend's lora_add alone on one SmolLM2 layer's four projections
(qkv, o, gate_up, down), the adapters spread evenly over 64 decode rows and over 1,024 prefill
rows, microseconds per layer (mean of 50 calls each); no model is loaded.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

from bench.common import (RunResult, Timer, Workload, add_engine_flags, add_workload_args, environment_line,
                          load_workload, print_result)

WARMUP = [[1, 2, 3, 4, 5, 6, 7, 8] * 4]
TARGET = 0.85


def write_random_adapter(path: Path, arch, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory on every attention and MLP projection, random A and B (non-zero B)."""
    import torch
    from safetensors.torch import save_file

    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    shapes = ({"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
              if arch.fused_checkpoint else
              {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
               "up_proj": (h, i), "down_proj": (i, h)})
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (n_in, n_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes), "bias": "none"}))
    return path


def run(engine, workload: Workload, names: list[str | None], label: str) -> RunResult:
    from pagedserve.core.sampling_params import SamplingParams

    steps_before = engine.stats.num_steps_total
    with Timer() as t:
        for i, r in enumerate(workload.requests):
            engine.add_request(f"{label}-{i}", r.prompt_ids,
                               SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True),
                               lora_name=names[i % len(names)])
        useful = 0
        while engine.has_unfinished_requests():
            useful += sum(len(out.new_token_ids) for out in engine.step())
    steps = engine.stats.num_steps_total - steps_before
    return RunResult(label, t.elapsed, workload.total_prompt_tokens, useful, {"steps": steps})


class KernelClock:
    """Wraps the engine's lora_add to add up the seconds spent in it."""

    def __init__(self, slots) -> None:
        self.slots, self.inner, self.seconds, self.calls = slots, slots.kernel, 0.0, 0
        slots.kernel = self

    def __call__(self, *args) -> None:
        start = time.perf_counter()
        self.inner(*args)
        self.seconds += time.perf_counter() - start
        self.calls += 1


def bench_dtype(args: argparse.Namespace, dtype: str, adapters_dir: Path) -> float:
    from pagedserve.core.engine import LLMEngine
    from pagedserve.tools.engine_args import engine_config_from_args

    config = engine_config_from_args(args).replace(dtype=dtype, enable_lora=True, max_loras=args.num_adapters,
                                                   max_lora_rank=args.rank)
    engine = LLMEngine(config)
    names = []
    for k in range(args.num_adapters):
        path = write_random_adapter(adapters_dir / f"{dtype}-{k}", engine.arch, args.rank, seed=k)
        engine.add_lora(f"adapter{k}", str(path))
        names.append(f"adapter{k}")
    workload = load_workload(args.workload, engine.tokenizer, verbose=dtype == args.dtypes[0]).head(args.num_requests)
    run(engine, Workload("warmup", "", [r._replace(prompt_ids=WARMUP[0], max_new_tokens=4)
                                        for r in workload.requests[:len(names)]]), names, "warmup")
    clock = KernelClock(engine.runner.lora)
    bases, loras = [], []
    for k in range(args.repeats):
        bases.append(run(engine, workload, [None], f"base-{dtype}"))
        kernel_before = clock.seconds
        loras.append(run(engine, workload, names, f"lora-{dtype}"))
        loras[-1].extra["lora_kernel_ms_per_step"] = round(
            1000 * (clock.seconds - kernel_before) / max(loras[-1].extra["steps"], 1), 2)
        for r in (bases[-1], loras[-1]):
            r.extra["ms_per_step"] = round(1000 * r.wall_s / max(r.extra["steps"], 1), 1)
            print_result(r)
    base, lora = min(bases, key=lambda r: r.wall_s), min(loras, key=lambda r: r.wall_s)
    per_step_ms = lora.extra["lora_kernel_ms_per_step"]
    ratio = lora.output_tokens_per_s / base.output_tokens_per_s
    print(f"[{dtype}] fastest of {args.repeats}: LoRA kernel {per_step_ms:.1f} ms/step, step "
          f"{lora.extra['ms_per_step'] - base.extra['ms_per_step']:+.1f} ms vs base; "
          f"ratio lora/base: {ratio:.2f}x (target >= {TARGET})")
    del engine
    gc.collect()
    return ratio


# SmolLM2-135M's projections: (part boundaries of the output, in_features).
SMOLLM2_PROJECTIONS = {"qkv": ((0, 576, 768, 960), 576), "o": ((0, 576), 576), "gate_up": ((0, 1536, 3072), 576),
                       "down": ((0, 576), 1536)}


def kernel_microbench(dtypes: list[str], num_adapters: int, rank: int, calls: int = 50) -> None:
    import torch

    from pagedserve.kernels.cpu import lora as cpu_lora

    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for rows in (64, 1024):
            total = 0.0
            for name, (out_slices, n_in) in SMOLLM2_PROJECTIONS.items():
                parts, n_out = len(out_slices) - 1, out_slices[-1]
                a = (torch.randn(num_adapters, parts * rank, n_in, generator=g) / n_in**0.5).to(dt)
                b = torch.zeros(num_adapters, parts * rank, n_out)
                for p in range(parts):
                    b[:, p * rank:(p + 1) * rank, out_slices[p]:out_slices[p + 1]] = 0.01 * torch.randn(
                        num_adapters, rank, out_slices[p + 1] - out_slices[p], generator=g)
                b = b.to(dt)
                x, y = torch.randn(rows, n_in, generator=g).to(dt), torch.zeros(rows, n_out, dtype=dt)
                slots = torch.arange(rows, dtype=torch.int32) % num_adapters
                for _ in range(5):  # warm: thread pool, first AMX use
                    cpu_lora.lora_add(y, x, a, b, slots, None, out_slices)
                start = time.perf_counter()
                for _ in range(calls):
                    cpu_lora.lora_add(y, x, a, b, slots, None, out_slices)
                us = 1e6 * (time.perf_counter() - start) / calls
                total += us
                print(f"[microbench {dtype}] {rows} rows {name}: {us:.1f} us")
            print(f"[microbench {dtype}] {rows} rows, one layer: {total:.0f} us")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    add_engine_flags(ap, model="default", block_size=16, max_model_len=2048)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated model dtypes to run")
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating")
    ap.add_argument("--kernel-microbench", action="store_true", help="time lora_add alone (no model), then exit")
    args = ap.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    print(environment_line())
    if args.kernel_microbench:
        kernel_microbench(args.dtypes, args.num_adapters, args.rank)
        return
    with tempfile.TemporaryDirectory(prefix="pagedserve-lora-bench-") as tmp:
        ratios = {dtype: bench_dtype(args, dtype, Path(tmp)) for dtype in args.dtypes}
    print("ratio lora/base: " + ", ".join(f"{d} {r:.2f}x" for d, r in ratios.items()))


if __name__ == "__main__":
    main()
