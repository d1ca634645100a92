"""Weight-only int8 linear layers in plain torch: how a weight is quantized at load
(`quantization: int8`), how GGUF Q8_0 blocks map onto the same form, and the oracle the C++ kernels
(kernels/cpu/int8_linear.cpp) are tested against.

A quantized weight is q int8 [out, in] and float32 scales [in / group_size, out]: weight[n, k] =
q[n, k] * scales[k // group_size, n]. Made at load: one group per row (per-output-channel symmetric:
scale = max |w[n, :]| / 127, q in [-127, 127]), the codes either rounded to nearest or, given the
inputs' second moments from a calibration run, chosen so that the layer's outputs move least (GPTQ's
error feedback, below). From GGUF Q8_0: groups of 32 k, each block's fp16 scale kept as it is (no
requantization, so no second rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

Q8_0_BLOCK = 32
"""k values per GGUF Q8_0 block (one fp16 scale, 32 int8 codes)."""


@dataclass(frozen=True)
class Int8Weight:
    qweight: Tensor
    """int8 [out_features, in_features]."""
    scales: Tensor
    """float32 [in_features // group_size, out_features]."""
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [out, in] the codes stand for (exact in float64; fp32 rounds each product)."""
        math = torch.float64 if dtype == torch.float64 else torch.float32
        per_k = self.scales.to(math).repeat_interleave(self.group_size, dim=0)  # [in, out]
        return (self.qweight.to(math) * per_k.T).to(dtype)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """dequantize()[ids] without the whole matrix (a tied embedding's lookup)."""
        per_k = self.scales[:, ids].repeat_interleave(self.group_size, dim=0)  # [in, len(ids)]
        return (self.qweight[ids].float() * per_k.T).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4


def quantize_per_channel(weight: Tensor, hessian: Tensor | None = None) -> Int8Weight:
    """Symmetric int8 per output row; an all-zero row gets scale 1 (codes 0).

    hessian: None rounds every weight to its nearest code. Else the sum of x x^T over the layer's
    inputs x in a calibration run ([in, in]): the codes are then chosen column by column, each
    column's rounding error carried into the columns not yet rounded as far as the inputs'
    correlation lets the layer's output make up for it (error_feedback_codes). Same scales, same
    format, same kernels: only the codes change.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    if hessian is None:
        q = torch.round(w / scale[:, None]).clamp_(-127, 127)
    else:
        q = error_feedback_codes(w, scale, hessian)
    return Int8Weight(q.to(torch.int8).contiguous(), scale[None, :].contiguous(), weight.shape[1])


HESSIAN_DAMPING = 0.1
"""Added to the Hessian's diagonal, times its mean: how far the codes may lean on correlations seen
in the calibration run. SmolLM2-135M's argmax agreement with fp32 measured best at 0.1 among 0.01,
0.1 and 0.3 (docs/quantization.md); GPTQ's paper uses 0.01 for models 10-1000x larger."""
BLOCK_COLUMNS = 128
"""Columns rounded one by one before their errors reach the rest in one matrix product (GPTQ's lazy
batch update: the same result, in fewer passes over the weight)."""


@torch.no_grad()
def error_feedback_codes(w: Tensor, scale: Tensor, hessian: Tensor, damping: float = HESSIAN_DAMPING,
                         block: int = BLOCK_COLUMNS) -> Tensor:
    """GPTQ (Frantar et al., 2022) for per-row scales: codes (float, integral) [out, in] for weight w
    [out, in] that minimize ||X (w - q * scale)^T|| over the calibration inputs X (hessian = X^T X)
    greedily, one input column at a time, the most active inputs first. After a column is rounded,
    its error e is compensated by moving the columns not yet rounded by e * H^-1[j, rest] / H^-1[j, j]
    (the optimal update for a quadratic loss), read off the upper Cholesky factor of H^-1.
    Inputs never active in the calibration run (zero diagonal) are rounded to nearest."""
    n = w.shape[1]
    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    h = h[order][:, order]
    h += damping * torch.diagonal(h).mean() * torch.eye(n, dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(inverse, upper=True).to(torch.float32)  # H^-1 = U^T U
    # Transposed, so that an input column is a contiguous row.
    wt = w.T[order].contiguous()  # [in, out]
    q = torch.empty_like(wt)
    inv_scale = 1.0 / scale
    for start in range(0, n, block):
        end = min(start + block, n)
        ub = u[start:end, start:end]
        errors = torch.empty_like(wt[start:end])
        for j in range(end - start):
            row = wt[start + j]
            code = torch.round(row * inv_scale).clamp_(-127, 127)
            q[start + j] = code
            errors[j] = (row - code * scale) / ub[j, j]
            wt[start + j + 1:end].addr_(ub[j, j + 1:], errors[j], alpha=-1.0)
        wt[end:].addmm_(u[start:end, end:].T, errors, alpha=-1.0)
    return q[torch.argsort(order)].T


def from_q8_0(codes: Tensor, block_scales: Tensor) -> Int8Weight:
    """GGUF Q8_0 as stored: codes int8 [out, in], block_scales (fp16 or fp32) [out, in / 32]."""
    out_features, in_features = codes.shape
    if in_features % Q8_0_BLOCK or tuple(block_scales.shape) != (out_features, in_features // Q8_0_BLOCK):
        raise ValueError(f"Q8_0: codes {tuple(codes.shape)} and block scales {tuple(block_scales.shape)} do not "
                         f"match (one scale per {Q8_0_BLOCK} values of a row)")
    return Int8Weight(codes.to(torch.int8).contiguous(), block_scales.float().T.contiguous(), Q8_0_BLOCK)


def int8_linear(x: Tensor, weight: Int8Weight, bias: Tensor | None = None) -> Tensor:
    """x @ weight.dequantize().T + bias, summed in fp32, returned in x's dtype."""
    y = x.float() @ weight.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def reference_int8_linear(weight: Int8Weight, dtype: torch.dtype):
    """A function (x, bias) -> int8_linear(x, weight, bias), with .rows(ids) (in `dtype`, the model's)
    for a tied embedding: the layer where no kernel takes the weight (another shape, the reference
    backend)."""

    def linear(x: Tensor, bias: Tensor | None) -> Tensor:
        return int8_linear(x, weight, bias)

    linear.rows = lambda ids: weight.rows(ids, dtype)  # type: ignore[attr-defined]
    linear.int8_weight = weight  # type: ignore[attr-defined]
    linear.nbytes = weight.nbytes  # type: ignore[attr-defined]
    return linear
