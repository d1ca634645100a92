"""Linear layers with weights packed once at load into the layout a kernel streams, each weight
byte read once per call: bf16 on Intel AMX (amx_linear.cpp); on AVX-512 (simd_linear.cpp) fp32,
bf16 by AVX512-BF16's dot product where the CPU has it without AMX, and bf16 in fp32 math where it
has no bf16 instructions; fp32 on AVX2 with FMA (simd_linear.cpp's ymm blocks).

Measured on a 2-core AMX Xeon, SmolLM2-135M's 120 decoder projections with cold weights, bf16:
56 rows 20.6 -> 15.5 ms, one row 15.2 -> 10.9 ms, 512 rows 68.7 -> 58.9 ms against oneDNN's
packed bf16 matmul; in the W64 benchmark the 49152-wide vocabulary projection at decode took 3.7
-> 3.1 ms per step (slower than oneDNN with the weights hot in cache, 2.4 vs 1.9 ms, which they
never are between steps). fp32 on a 2-core AVX-512 Xeon (no AMX exposed), the same 120
projections: 37 rows 50.7 -> 32.6 ms, 56 rows 62-67 -> 42-45 ms, 8 rows 35 -> 18 ms against
MKL's sgemm (F.linear), 1024 rows 730 -> 760 ms (within a few percent: the prefill is
compute-bound either way). fp32 on AMX (amx_fp32_linear.cpp, from 128 rows): SmolLM2's four
projections at 512 rows 7.8 ms a layer against 11.2-12.1 on the FMAs, the 512-token prefill
1,690-1,770 tok/s against 1,090-1,190 (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu.build import CpuKernelsUnavailable, load_extension


@dataclass(frozen=True)
class PackedKernel:
    """One kernel's entry points in the extension and the shapes its blocking takes."""

    available: str  # () -> bool
    pack: str  # (weight) -> packed
    run: str  # (x, packed, bias, out_features[, fp32_out], out) -> y (bf16 kernels take fp32_out)
    rows: str  # (packed, ids, in_features) -> weight[ids]
    out_multiple: int
    in_multiple: int
    # Taken only where native_bf16() is this (None: either way).
    needs_native_bf16: bool | None = None
    # (x, packed, bias, out_features) -> each row's argmax over `run`'s result, int64 [rows], the
    # outputs never stored (row_argmax.h); None: this kernel has none.
    argmax: str | None = None
    # (x, packed, bias, out_features, activation) -> act(gate) * up for a [gate | up] projection,
    # `run`'s result never stored; None: this kernel has none.
    gated: str | None = None


# Outputs in groups of 32 columns, inputs in slices of 32 (two 16 x 32 bf16 tiles).
AMX_BF16 = PackedKernel("amx_linear_available", "amx_pack_weight", "amx_linear", "amx_packed_rows", 32, 32,
                        argmax="amx_linear_argmax", gated="amx_gated_linear")
# Outputs in panels of 32 columns (two zmm registers); any number of inputs. Where AMX runs, calls of
# fp32_amx_min_rows() rows or more (prefill chunks) go to amx_fp32_linear.cpp over the same panels:
# each value split into three bf16 terms, six of their products summed in fp32 by the tile unit
# (errors at fp32's level, tests/kernels/test_amx_fp32_linear.py).
AVX512_FP32 = PackedKernel("avx512_kernels_available", "fp32_pack_weight", "fp32_linear", "fp32_packed_rows", 32, 1,
                           argmax="fp32_linear_argmax")
# bf16 panels of 32 columns with inputs in pairs, multiplied by vdpbf16ps (AVX512-BF16 CPUs without
# AMX: AMD Zen 4 and later, Cooper Lake). Unmeasured against oneDNN's bf16 matmul on such a CPU; the
# AMX kernel's measurements on the same streaming design are why it is preferred (docs/benchmarks.md).
AVX512_BF16_DOT = PackedKernel("avx512_kernels_available", "bf16_pack_weight", "bf16_dot_linear", "bf16_packed_rows",
                               32, 2, needs_native_bf16=True, argmax="bf16_dot_linear_argmax")
# The same panels in fp32 math: only where the CPU has no bf16 instructions, where oneDNN's bf16
# matmul emulates them (3.5x slower than this on an AVX-512 Xeon).
AVX512_BF16_FP32_MATH = PackedKernel("avx512_kernels_available", "bf16_pack_weight", "bf16_linear",
                                     "bf16_packed_rows", 32, 2, needs_native_bf16=False, argmax="bf16_linear_argmax")

# The same fp32 panels on AVX2 with FMA (CPUs without AVX-512), in ymm blocks of 6 rows x 16
# columns or 3 x 32: ahead of MKL's AVX2 sgemm where the weights stream cold at decode sizes, a few
# percent behind it on prefill chunks of ~1000 rows (docs/benchmarks.md).
AVX2_FP32 = PackedKernel("avx2_kernels_available", "fp32_pack_weight", "avx2_fp32_linear", "fp32_packed_rows", 32, 1)

# Per dtype, the kernels in order of preference; the first that runs here takes the weight.
_KERNELS = {
    torch.bfloat16: (AMX_BF16, AVX512_BF16_DOT, AVX512_BF16_FP32_MATH),
    torch.float32: (AVX512_FP32, AVX2_FP32),
}


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16; every AMX CPU has it too), which
    oneDNN's bf16 matmul and torch's bf16 attention use, and PAGEDSERVE_CPU_ISA allows them
    (isa.py). Without them both emulate bf16 slowly."""
    return isa.native_bf16()


@functools.lru_cache(maxsize=None)
def _runs_here(kernel: PackedKernel) -> bool:
    try:
        return bool(getattr(load_extension(), kernel.available)())
    except CpuKernelsUnavailable:
        return False


@functools.lru_cache(maxsize=None)
def _available(kernel: PackedKernel) -> bool:
    """Whether the kernel runs here and this CPU is one it is meant for."""
    if kernel.needs_native_bf16 is not None and kernel.needs_native_bf16 != native_bf16():
        return False
    return _runs_here(kernel)


def amx_available() -> bool:
    return _available(AMX_BF16)


def avx512_available() -> bool:
    """Whether the AVX-512 kernels (fp32 linear layers here, bf16 ones per bf16_fp32_math_available
    and AVX512_BF16_DOT, and attention.py's prefill) run here."""
    return _available(AVX512_FP32)


def avx2_fp32_available() -> bool:
    """Whether fp32 layers can take the AVX2 kernel here (and attention.py's prefill its AVX2 entry):
    AVX2 with FMA. Where AVX-512 runs too, that is preferred."""
    return _available(AVX2_FP32)


def bf16_fp32_math_available() -> bool:
    """Whether bf16 layers take the AVX-512 kernels' fp32 math here (AVX-512, no native bf16)."""
    return _available(AVX512_BF16_FP32_MATH)


def runnable_kernels(dtype: torch.dtype) -> tuple[PackedKernel, ...]:
    """This dtype's kernels that run on this CPU, preferred first, whether or not it is one they
    are meant for (bench/linear_kernels.py compares them all)."""
    return tuple(kernel for kernel in _KERNELS.get(dtype, ()) if _runs_here(kernel))


def _kernel_for(weight: Tensor) -> PackedKernel | None:
    out_features, in_features = weight.shape
    for kernel in _KERNELS.get(weight.dtype, ()):
        if out_features % kernel.out_multiple == 0 and in_features % kernel.in_multiple == 0 and _available(kernel):
            return kernel
    return None


def prepack_linear(weight: Tensor) -> Callable[[Tensor, Tensor | None], Tensor] | None:
    """A function (x, bias) -> x @ weight.T + bias over a packed copy of ``weight`` [out, in], or
    None where no kernel applies (not a CPU bf16 / fp32 matrix, a shape off the kernels' blocking,
    no kernel for this dtype on this CPU); the caller then keeps its own path."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    kernel = _kernel_for(weight)
    return None if kernel is None else packed_linear(kernel, weight)


def packed_linear(kernel: PackedKernel, weight: Tensor) -> Callable[[Tensor, Tensor | None], Tensor]:
    """prepack_linear's function through this kernel, whichever this CPU prefers (it must run here
    and take the weight's dtype and shape): how tests reach every kernel a CPU can run."""
    out_features, in_features = weight.shape
    ext = load_extension()
    packed = getattr(ext, kernel.pack)(weight.contiguous())
    run, read_rows = getattr(ext, kernel.run), getattr(ext, kernel.rows)

    bf16 = weight.dtype == torch.bfloat16

    def linear(x: Tensor, bias: Tensor | None, fp32_out: bool = False, out: Tensor | None = None) -> Tensor:
        """fp32_out: a bf16 layer's results (rounded to bf16 as always) returned widened to fp32,
        what .float() of its bf16 result gives, in one pass instead of two (the LM head's logits);
        fp32 layers return fp32 anyway. out: a contiguous [rows, out_features] tensor of the result's
        dtype to write (and return) instead of a new one."""
        x = x if x.is_contiguous() else x.contiguous()
        if bf16:
            return run(x, packed, bias, out_features, fp32_out, out)
        return run(x, packed, bias, out_features, out)

    def rows(ids: Tensor) -> Tensor:
        """weight[ids] read back from the packed copy (a tied embedding's lookup)."""
        return read_rows(packed, ids, in_features)

    if kernel.argmax is not None:
        run_argmax = getattr(ext, kernel.argmax)

        def argmax(x: Tensor, bias: Tensor | None) -> Tensor:
            """Each row's argmax over linear(x, bias) (int64 [rows]: greedy tokens from the LM head),
            the outputs folded as they are computed and never stored."""
            return run_argmax(x if x.is_contiguous() else x.contiguous(), packed, bias, out_features)

        linear.argmax = argmax  # type: ignore[attr-defined]
    if kernel.gated is not None and out_features % (2 * kernel.out_multiple) == 0:
        run_gated = getattr(ext, kernel.gated)

        def gated(x: Tensor, bias: Tensor | None, activation: str) -> Tensor:
            """act(gate) * up ("silu" or "gelu_tanh") for this layer as a [gate | up] projection:
            what silu_and_mul / gelu_tanh_and_mul over linear(x, bias) gives, that result never stored."""
            return run_gated(x if x.is_contiguous() else x.contiguous(), packed, bias, out_features, activation)

        linear.gated = gated  # type: ignore[attr-defined]
    linear.packed = packed  # type: ignore[attr-defined]  # for tests and memory accounting
    linear.kernel = kernel  # type: ignore[attr-defined]
    linear.rows = rows  # type: ignore[attr-defined]
    linear.fp32_out = True  # type: ignore[attr-defined]  # takes fp32_out and out (core/layers/linear.py)
    return linear
