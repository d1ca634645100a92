"""What a linear kernel's outputs must be, judged against the exact product (float64) alone.

Every CPU linear kernel (simd_linear.cpp, amx_linear.cpp) sums each output in fp32, in blocks of at
most 128 inputs whose partial sums are then added up, plus the bias. The classic bound for a
recursive fp32 sum of n terms (Higham, Accuracy and Stability of Numerical Algorithms, 4.2) gives
every output's distance from the exact value:

    |got - exact| <= gamma(n) * sum(|terms|),   gamma(n) = n u / (1 - n u),   u = 2^-24,

with n = 128 + ceil(K / 128) + 1 additions on the longest path (a block, the blocks' sums, the
bias). bf16 outputs are that fp32 sum rounded once to bf16: equal to the exact value rounded to
bf16, except where the fp32 sum's error reaches across a rounding midpoint, where the neighbouring
bf16 value is right too.

fp32 layers on AMX (amx_fp32_linear.cpp) split each value into three bf16 terms, x = xh + xm + xl
(+ a rest below 2^-27 |x|), and add six of the nine products, each exact in fp32, into one fp32
accumulator in turn, 32 k at a time: every term on one path, n = 6 * ceil(K / 32) * 32 + 1
additions with the bias, over terms whose magnitudes sum to at most (1 + 2^-7) sum(|x| |w|); the
three products left out (xm wl, xl wm, xl wl) and the rests add at most 2^-24 sum(|x| |w|)
(assert_fp32_split_accurate).

These are properties of a correct kernel, whatever the host and whatever other libraries do: no
check counts another library's misses (oneDNN's bf16 matmul takes another path, and another
summation order, on every kind of CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

U = 2.0**-24  # fp32 unit roundoff
SUM_BLOCK = 128  # inputs summed apart before the blocks' sums are added (fp32_gemm.h's kSumBlock)


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


def fp32_sum_error_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                         longest_sum: int | None = None) -> torch.Tensor:
    """Per output, the most a blocked fp32 sum of these terms can be off the exact value
    (longest_sum: the additions on the kernel's longest path, when it does not sum in blocks of
    128; an AMX tile accumulator adds every pair of k in turn: in_features + 1)."""
    in_features = x.shape[-1]
    n = longest_sum if longest_sum is not None else SUM_BLOCK + math.ceil(in_features / SUM_BLOCK) + 1
    gamma = n * U / (1 - n * U)
    magnitude = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
    return gamma * magnitude


def assert_fp32_accurate(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    assert got.dtype == torch.float32
    err = (got.double() - exact(x, w, bias)).abs()
    bound = fp32_sum_error_bound(x, w, bias)
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"output {worst.item()} off by {err.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g}"


def assert_fp32_split_accurate(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                               bias: torch.Tensor | None) -> None:
    """got is within the bound of amx_fp32_linear.cpp's sum (above) of the exact product."""
    assert got.dtype == torch.float32
    in_features = x.shape[-1]
    n = 6 * math.ceil(in_features / 32) * 32 + 1
    gamma = n * U / (1 - n * U)
    magnitude = F.linear(x.double().abs(), w.double().abs())
    bias_magnitude = 0 if bias is None else bias.double().abs()
    bound = gamma * ((1 + 2.0**-7) * magnitude + bias_magnitude) + 2.0**-24 * magnitude
    err = (got.double() - exact(x, w, bias)).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"output {worst.item()} off by {err.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g}"


def assert_bf16_rounded_once(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                             longest_sum: int | None = None) -> None:
    """got is the exact product rounded to bf16, but where the fp32 sum's own error reaches across a
    rounding midpoint; there it is the rounding of a value within that error of the exact one: the
    neighbouring bf16 value, or, for an output near zero against the size of its terms (where the
    error spans several bf16 steps), one of those steps."""
    assert got.dtype == torch.bfloat16
    want = exact(x, w, bias)
    rounded = want.to(torch.bfloat16)
    off = got != rounded
    if not off.any():
        return
    bound = fp32_sum_error_bound(x, w, bias, longest_sum)
    # A neighbour: at most one bf16 step (8 significant bits) away, unless the error bound is wider ...
    _, exponent = torch.frexp(torch.maximum(got.double().abs(), rounded.double().abs()))
    step = torch.ldexp(torch.ones_like(want), exponent - 8)
    far = (got.double() - rounded.double()).abs() > step
    assert (bound[off & far] >= step[off & far]).all(), "a bf16 output more than a step off"
    # ... and only where the exact value lies within the fp32 sum's error of a value rounding to got.
    half_step = torch.ldexp(torch.ones_like(want), torch.frexp(got.double().abs())[1] - 9)
    assert ((want - got.double()).abs()[off] <= (bound + half_step)[off]).all(), \
        "a bf16 output off by more than the fp32 sum's error"
