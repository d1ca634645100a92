"""The packed linear kernels against torch's GEMM on this CPU: which one should take the layers.

    python -m bench.linear_kernels [--dtype bfloat16|float32 ...] [--rows 1 8 56 512] [--repeats 3]

SmolLM2-135M's 120 decoder projections (the embedded default model: per layer the fused QKV
960x576, the output 576x576, the fused gate/up 3072x576 and the down 1536->576), each with its
own weight, so the weights stream from memory on every pass as they do between decode steps.
For each dtype and row count it times one pass through each of:

* torch: what a layer runs when no kernel takes it (core/layers/linear.py: oneDNN's packed bf16
  matmul, F.linear (MKL) for fp32);
* every packed kernel of pagedserve.kernels.cpu.linear that runs on this CPU, whichever the
  engine would pick here (marked `*`). On AMX hosts `avx512-fp32` at 128 rows or more is
  fp32_linear's AMX path (amx_fp32_linear.cpp), as the engine runs it.

Output: best-of-N milliseconds per pass and GFLOP/s, then per row count which is fastest and the
picked kernel's speed relative to torch. Name the CPU flags with the figures (printed first):
the picks differ between AVX2, AVX-512, AVX512-BF16 and AMX hosts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench.common import environment_line
from pagedserve.core.layers.linear import Linear
from pagedserve.kernels.cpu import linear as cpu_linear

# (out_features, in_features) of one SmolLM2-135M decoder layer's projections; 30 layers.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS = 30
KERNELS = {"amx-bf16": cpu_linear.AMX_BF16, "avx512-bf16-dot": cpu_linear.AVX512_BF16_DOT,
           "avx512-bf16-fp32-math": cpu_linear.AVX512_BF16_FP32_MATH, "avx512-fp32": cpu_linear.AVX512_FP32,
           "avx2-fp32": cpu_linear.AVX2_FP32}


def cpu_flags() -> str:
    try:
        words = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in words) or "none of avx2/avx512"


def layers_for(name: str, weights: list[torch.Tensor]) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    if name == "torch":
        return [Linear(w) for w in weights]
    kernel = KERNELS[name]
    return [(lambda x, f=cpu_linear.packed_linear(kernel, w): f(x, None)) for w in weights]


def candidates(dtype: torch.dtype) -> list[str]:
    """torch, then each kernel for this dtype that runs on this CPU."""
    runnable = cpu_linear.runnable_kernels(dtype)
    return ["torch"] + [name for name, kernel in KERNELS.items() if kernel in runnable]


def picked(dtype: torch.dtype) -> str:
    """What the engine takes here for this dtype's SmolLM2 layers."""
    w = torch.zeros(LAYER_SHAPES[0], dtype=dtype)
    fn = cpu_linear.prepack_linear(w)
    if fn is None:
        return "torch"
    return next(name for name, kernel in KERNELS.items() if kernel is fn.kernel)


def time_pass(layers, inputs, repeats: int) -> float:
    def one_pass() -> None:
        for layer, (_, k) in zip(layers, LAYER_SHAPES * NUM_LAYERS):
            layer(inputs[k])
    one_pass()  # warm-up (first-touch, thread pool)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 56, 512])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(environment_line())
    print(f"[env] cpu flags: {cpu_flags()}")
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        weights = [(torch.randn(shape, generator=gen) * 0.02).to(dtype) for shape in LAYER_SHAPES * NUM_LAYERS]
        names, pick = candidates(dtype), picked(dtype)
        built = {name: layers_for(name, weights) for name in names}
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {k for _, k in LAYER_SHAPES}}
            flops = 2 * rows * NUM_LAYERS * sum(n * k for n, k in LAYER_SHAPES)
            times = {name: time_pass(built[name], inputs, args.repeats) for name in names}
            for name in names:
                mark = "*" if name == pick else " "
                print(f"{dtype_name:9s} rows {rows:4d} {mark}{name:22s} {times[name] * 1e3:8.2f} ms "
                      f"{flops / times[name] / 1e9:6.0f} GFLOP/s", flush=True)
            fastest = min(times, key=times.get)
            print(f"{dtype_name:9s} rows {rows:4d}  fastest: {fastest}; picked {pick}: "
                  f"{times['torch'] / times[pick]:.2f}x torch", flush=True)


if __name__ == "__main__":
    main()
