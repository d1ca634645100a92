"""Weight-only int8 linear layers on CPU (int8_linear.cpp): the weights stay int8 in memory, half
of bf16's bytes, and are widened in registers.

* bf16 activations on a CPU with AVX512-BF16 (Zen 4, Cooper Lake, every AMX Xeon): int8_dot_linear,
  each weight widened to bf16 and multiplied by vdpbf16ps, as the bf16 layers are (linear.py).
  On AMX, from AMX_MIN_ROWS rows on (prefill, batched decode), per-column scales only:
  int8_amx_linear (amx_int8_linear.cpp), each panel widened once per call into tdpbf16ps tiles;
  both read the same packed codes, so the layer picks per call by its row count.
* otherwise (fp32 activations, or no AVX512-BF16) on AVX2 with FMA: int8_avx2_linear, fp32 math.

A shape off the kernels' blocking (out_features not a multiple of 32, odd in_features) or a CPU
with neither returns None: the layer then runs kernels/reference/int8_linear.py's torch path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu.build import CpuKernelsUnavailable, load_extension
from pagedserve.kernels.reference.int8_linear import Int8Weight

DOT = "int8_dot_linear"
AVX2 = "int8_avx2_linear"
AMX = "int8_amx_linear"
AMX_MIN_ROWS = 4
"""Rows from which int8_amx_linear takes a call (below, the layer reads its weights once per row
block and the vector kernel is as fast; measured in docs/benchmarks.md)."""
PANEL = 32  # output columns per packed panel


@functools.lru_cache(maxsize=None)
def _runs_here(kernel: str) -> bool:
    try:
        ext = load_extension()
    except CpuKernelsUnavailable:
        return False
    return bool(ext.avx512_kernels_available() if kernel == DOT else ext.avx2_kernels_available())


def runnable_kernels() -> tuple[str, ...]:
    """The int8 kernels this CPU (under PAGEDSERVE_CPU_ISA's cap) runs, whether or not they are
    the one it would choose (tests reach each; int8_dot_linear without AVX512-BF16 runs an emulation)."""
    return tuple(k for k in (DOT, AVX2) if _runs_here(k)) + ((AMX,) if _runs_here(DOT) and _amx_runs_here() else ())


def kernel_for(dtype: torch.dtype) -> str | None:
    """The kernel activations of this dtype take here, or None (the torch reference)."""
    if dtype == torch.bfloat16 and isa.native_bf16() and _runs_here(DOT):
        return DOT
    if dtype in (torch.bfloat16, torch.float32) and _runs_here(AVX2):
        return AVX2
    return None


def prepack_int8_linear(weight: Int8Weight, dtype: torch.dtype) -> Callable[[Tensor, Tensor | None], Tensor] | None:
    """A function (x, bias) -> x @ weight.dequantize().T + bias for x of `dtype` (the model's), over
    a packed copy of the codes, or None where no kernel takes it here."""
    n, k = weight.qweight.shape
    kernel = kernel_for(dtype)
    if kernel is None or weight.qweight.device.type != "cpu" or n % PANEL or k % 2 or weight.group_size % 2:
        return None
    if kernel == DOT and weight.group_size >= k and k % 32 == 0 and _amx_runs_here():
        kernel = AMX
    return packed_int8_linear(kernel, weight, dtype)


def _amx_runs_here() -> bool:
    from pagedserve.kernels.cpu.linear import amx_available  # the bf16 AMX layers' own check
    return amx_available()


def packed_int8_linear(kernel: str, weight: Int8Weight, dtype: torch.dtype) -> Callable[[Tensor, Tensor | None], Tensor]:
    """prepack_int8_linear's function through `kernel` (one of runnable_kernels()): tests use it to
    reach each kernel."""
    ext = load_extension()
    n, k = weight.qweight.shape
    packed = ext.int8_pack_weight(weight.qweight.contiguous())
    scales, group = weight.scales.contiguous(), weight.group_size
    run = getattr(ext, kernel)
    few_rows = ext.int8_dot_linear if kernel == AMX else run  # AMX: only from AMX_MIN_ROWS rows on

    def linear(x: Tensor, bias: Tensor | None) -> Tensor:
        x = x if x.is_contiguous() else x.contiguous()
        return (run if x.shape[0] >= AMX_MIN_ROWS else few_rows)(x, packed, scales, bias, n, group)

    def rows(ids: Tensor) -> Tensor:
        """The dequantized weight's rows `ids` in the model dtype (a tied embedding's lookup), read
        from the packed panels: row n at k is byte (n // 32, k, n % 32) of the [n / 32, k, 32] view."""
        codes = packed.view(n // PANEL, k, PANEL)[ids // PANEL, :, ids % PANEL]  # [len(ids), k]
        per_k = scales[:, ids].repeat_interleave(group, dim=0).T  # [len(ids), k]
        return (codes.float() * per_k).to(dtype)

    if kernel == AMX:
        # The LM head under greedy decoding and a gated MLP's gate_up: the AMX kernel folds or
        # gates its own results (core/layers/linear.py calls these from fused_min_rows rows on).
        def argmax(x: Tensor, bias: Tensor | None) -> Tensor:
            x = x if x.is_contiguous() else x.contiguous()
            return ext.int8_amx_linear_argmax(x, packed, scales, bias, n)

        def gated(x: Tensor, bias: Tensor | None, activation: str) -> Tensor:
            x = x if x.is_contiguous() else x.contiguous()
            return ext.int8_amx_gated_linear(x, packed, scales, bias, n, activation)

        linear.argmax = argmax  # type: ignore[attr-defined]
        if n % (2 * PANEL) == 0:
            linear.gated = gated  # type: ignore[attr-defined]
        linear.fused_min_rows = AMX_MIN_ROWS  # type: ignore[attr-defined]
    linear.packed = packed  # type: ignore[attr-defined]  # for tests and memory accounting
    linear.kernel = kernel  # type: ignore[attr-defined]
    linear.rows = rows  # type: ignore[attr-defined]
    linear.nbytes = packed.numel() + scales.numel() * 4  # type: ignore[attr-defined]
    return linear
