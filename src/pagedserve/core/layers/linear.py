"""Linear layers whose weights are prepared once, at load, for the device's fastest GEMM.

On CPU, bf16 weights are reordered once into oneDNN's blocked layout for its AMX / AVX-512 BF16
matmul (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's weight freezing does), so no
call reorders them again. Measured on a 2-core AMX Xeon, the four projections of SmolLM2's 30
layers with cold weights: 29 -> 18 ms at 1 row, 39 -> 26 ms at 64 rows, 86 -> 78 ms at 256 rows,
the same at 1024 (packed for 64 rows; packing for 1, 16, 256 or 1024 rows measured no better).
fp32 weights are not repacked for oneDNN: its packed fp32 path and MKL's packed GEMM (packed for
one batch size only) measured no faster than F.linear. The plain weight is dropped once packed.

With `int8=True` (`quantization: int8`), or given an Int8Weight (a GGUF Q8_0 tensor kept
quantized), the layer holds int8 codes and scales instead (kernels/reference/int8_linear.py):
`prepack_int8` (pagedserve.kernels.cpu.prepack_int8_linear) packs them for its kernel, else the torch
reference computes the layer. Either way the call is the same, so whatever the model adds after a
projection (a LoRA delta, a bias) works unchanged.

A kernel backend may do better still: `prepack` (pagedserve.kernels.cpu.linear.prepack_linear: bf16
on AMX or AVX-512, fp32 on AVX-512) gets the weight first and, when it returns a function, that function
computes the layer and neither the plain nor the oneDNN copy is kept.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels.reference.int8_linear import Int8Weight, quantize_per_channel, reference_int8_linear

logger = logging.getLogger(__name__)

# Rows the oneDNN packing is tuned for (the decode batch sizes that dominate serving).
_PACK_FOR_ROWS = 64


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and _onednn_packs_bf16())


@functools.lru_cache(maxsize=1)
def _onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT,
    and refuses on plain AVX2 CPUs, where the plain F.linear path runs (asked once, not per layer)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), _PACK_FOR_ROWS)
    except RuntimeError as exc:
        logger.info("oneDNN does not pack bf16 weights here; bf16 layers use plain matmuls: %s", exc)
        return False
    return True


class Linear:
    """y = x @ weight.T + bias for x [rows, in_features] (rows may be 0)."""

    __slots__ = ("weight", "bias", "packed", "kernel", "in_features", "out_features")

    def __init__(self, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None, pack: bool = True,
                 prepack: Callable[[torch.Tensor], Callable | None] | None = None, int8: bool = False,
                 prepack_int8: Callable[[Int8Weight, torch.dtype], Callable | None] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        """int8: quantize `weight` per output channel (or `weight` is an Int8Weight already; `dtype`,
        the model's, is then the activations' dtype)."""
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if int8 or isinstance(weight, Int8Weight):
            quantized = weight if isinstance(weight, Int8Weight) else quantize_per_channel(weight)
            act_dtype = dtype or (weight.dtype if isinstance(weight, torch.Tensor) else torch.float32)
            self.out_features, self.in_features = quantized.qweight.shape
            self.weight = None
            self.kernel = ((prepack_int8(quantized, act_dtype) if pack and prepack_int8 is not None else None)
                           or reference_int8_linear(quantized, act_dtype))
            return
        self.out_features, self.in_features = weight.shape
        self.weight: torch.Tensor | None = weight
        # kernel(x, bias): the backend's own packed layer, when it took this weight.
        self.kernel = prepack(weight) if pack and prepack is not None else None
        if self.kernel is not None:
            self.weight = None
        elif pack and _can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_FOR_ROWS)
                self.weight = None
            except RuntimeError as exc:  # an odd build of torch: the plain path still works
                logger.warning("oneDNN weight packing unavailable, using plain matmuls: %s", exc)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.bias)
        if self.packed is not None and x.shape[0] > 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.packed is not None:  # no rows: oneDNN refuses empty inputs
            return x.new_empty((0, self.out_features))
        return F.linear(x, self.weight, self.bias)

    def float_out(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """self(x).float(): a bf16 layer's results as ever (rounded to bf16, as transformers' and
        vLLM's logits are), in float32. A kernel that can store them widened does so in the same
        pass (kernels/cpu/linear.py), into `out` (float32 [rows, out_features], contiguous) when
        given; other paths (the int8 kernels, torch's matmul) convert their result into `out`."""
        if self.kernel is not None and getattr(self.kernel, "fp32_out", False):
            return self.kernel(x, self.bias, fp32_out=True, out=out)
        return self(x).float() if out is None else out.copy_(self(x))

    def argmax(self, x: torch.Tensor, argmax_rows: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """argmax_rows(self.float_out(x)), int64 [rows]: greedy tokens from an LM head. A kernel that
        folds its outputs into each row's argmax as it computes them (kernels/cpu/row_argmax.h)
        never stores the logits; the others compute them and take argmax_rows, whose rule (the
        first of equal maxima, a row's first NaN) the kernels keep."""
        fused = self._fused("argmax", x)
        if fused is not None:
            return fused(x, self.bias)
        return argmax_rows(self.float_out(x))

    def act_and_mul(self, x: torch.Tensor, activation: str,
                    act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """act_and_mul(self(x)) for a [gate | up] projection (a gated MLP's gate_up): `activation`
        ("silu" or "gelu_tanh") names what act_and_mul computes. A kernel that applies it to its
        own outputs (AMX: amx_gated_linear) never stores the [rows, 2 n] projection; the others
        compute it and call act_and_mul."""
        fused = self._fused("gated", x)
        if fused is not None:
            return fused(x, self.bias, activation)
        return act_and_mul(self(x))

    def _fused(self, name: str, x: torch.Tensor) -> Callable | None:
        """The kernel's fused form `name` for x, or None: none, or x has fewer rows than the
        kernel's fused forms take (`fused_min_rows`: int8 on AMX, where few rows take the vector
        kernel, which has none)."""
        fused = getattr(self.kernel, name, None)
        if fused is None or x.shape[0] < getattr(self.kernel, "fused_min_rows", 0):
            return None
        return fused
