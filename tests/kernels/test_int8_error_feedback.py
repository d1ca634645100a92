"""kernels/reference/int8_linear.py: per-channel int8 codes chosen by error feedback (GPTQ) from a
calibration Hessian, against a plain sequential implementation of the same rule written here
(optimal brain surgeon: after each column is rounded, the columns still open move by the error
times a row of the inverse Hessian of the open columns, that inverse recomputed every time)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.reference.int8_linear import (HESSIAN_DAMPING, error_feedback_codes,
                                                      quantize_per_channel)


def sequential_codes(w: torch.Tensor, scale: torch.Tensor, hessian: torch.Tensor, damping: float) -> torch.Tensor:
    """The oracle: float64, one column at a time, the inverse of the open columns' Hessian taken afresh."""
    w = w.double().clone()
    scale = scale.double()
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damping * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    open_columns = torch.argsort(torch.diagonal(h), descending=True, stable=True).tolist()
    q = torch.zeros_like(w)
    while open_columns:
        j, rest = open_columns[0], open_columns[1:]
        inverse = torch.linalg.inv(h[open_columns][:, open_columns])
        q[:, j] = torch.round(w[:, j] / scale).clamp(-127, 127)
        error = (w[:, j] - q[:, j] * scale) / inverse[0, 0]
        w[:, rest] -= error[:, None] * inverse[0, 1:][None, :]
        open_columns = rest
    return q


def correlated_inputs(rows: int, n: int, seed: int, draw: int = 0) -> torch.Tensor:
    """Inputs whose features are correlated (as a layer's are), some much larger than others: the
    same distribution for one seed, another sample of it for each draw."""
    g = torch.Generator().manual_seed(seed)
    mix = (torch.randn(n, n, generator=g) / n**0.5 + torch.eye(n)) * torch.rand(n, generator=g).add(0.2)
    return torch.randn(rows, n, generator=torch.Generator().manual_seed(1000 * seed + draw)) @ mix


def output_error(x: torch.Tensor, w: torch.Tensor, quantized) -> float:
    return ((x.double() @ (w.double() - quantized.dequantize(torch.float64)).T) ** 2).sum().item()


@pytest.mark.parametrize("shape", [(8, 16), (24, 40), (5, 130)])  # 130: more than one block of columns
@pytest.mark.parametrize("block", [1, 7, 128])
def test_codes_match_the_sequential_rule(shape, block):
    out, n = shape
    g = torch.Generator().manual_seed(out * n + block)
    w = torch.randn(out, n, generator=g)
    x = correlated_inputs(4 * n, n, seed=n)
    hessian = x.double().T @ x.double()
    scale = quantize_per_channel(w).scales[0]
    got = error_feedback_codes(w, scale, hessian, block=block)
    want = sequential_codes(w, scale, hessian, HESSIAN_DAMPING)
    # float32 updates against float64: a weight landing within rounding of a half-way point may
    # take the other code; nothing else may differ.
    differ = got.double() != want
    assert differ.float().mean() <= 0.01 and (got.double() - want).abs().max() <= 1


@pytest.mark.parametrize("shape", [(64, 96), (192, 256)])
def test_error_feedback_moves_the_outputs_less_than_rounding(shape):
    out, n = shape
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(3))
    x = correlated_inputs(2000, n, seed=4)
    nearest = quantize_per_channel(w)
    calibrated = quantize_per_channel(w, x.double().T @ x.double())
    # Same format and scales, codes in range: only the codes change.
    assert calibrated.qweight.dtype == torch.int8 and calibrated.group_size == n
    assert torch.equal(calibrated.scales, nearest.scales)
    assert calibrated.qweight.abs().max() <= 127
    # On inputs like the calibration's (fresh draws), the outputs move clearly less.
    fresh = correlated_inputs(2000, n, seed=4, draw=1)
    assert output_error(fresh, w, calibrated) < 0.8 * output_error(fresh, w, nearest)


def test_uncorrelated_inputs_round_to_nearest():
    """A diagonal Hessian: no column can make up for another's error, so each weight takes its
    nearest code, whatever the inputs' scales."""
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(5))
    diagonal = torch.diag(torch.rand(48, generator=torch.Generator().manual_seed(6)) + 0.1).double()
    assert torch.equal(quantize_per_channel(w, diagonal).qweight, quantize_per_channel(w).qweight)


def test_inputs_never_seen_round_to_nearest_and_take_no_error():
    """An input that was zero all through calibration (a zero row and column of H) keeps its
    nearest code (its weights matter whenever it is not zero), and no other column's error lands on it."""
    n = 24
    w = torch.randn(16, n, generator=torch.Generator().manual_seed(7))
    x = correlated_inputs(400, n, seed=8)
    x[:, 5] = 0
    calibrated = quantize_per_channel(w, x.double().T @ x.double())
    assert torch.equal(calibrated.qweight[:, 5], quantize_per_channel(w).qweight[:, 5])
    assert not torch.equal(calibrated.qweight, quantize_per_channel(w).qweight)  # the others did move


def test_zero_rows_and_clamping():
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(9))
    w[2] = 0
    x = correlated_inputs(200, 32, seed=10)
    q = quantize_per_channel(w, x.double().T @ x.double())
    assert q.scales[0, 2] == 1 and not q.qweight[2].any()
    # The largest weight of a row is code +-127 before feedback; the carried errors may push
    # others past it, and they stay clamped to the symmetric range.
    assert q.qweight.min() >= -127 and q.qweight.max() <= 127
