"""Comparison of one output against its float64 golden, with the statistics Polygraphy reports."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutputStats:
    """`needed_atol` is the smallest atol that would pass with the same rtol (inf if none would)."""

    name: str
    shape: tuple[int, ...]
    golden_shape: tuple[int, ...]
    max_abs: float
    mean_abs: float
    max_rel: float
    p99_abs: float
    nrmse: float
    needed_atol: float
    nonfinite: int
    failing: int
    passed: bool


def compare(
    name: str, actual: torch.Tensor, golden: torch.Tensor, atol: float, rtol: float
) -> OutputStats:
    """An element passes when abs <= atol or rel <= rtol; NaN or Inf never passes; the output's
    shape must equal the golden's."""
    shape, golden_shape = tuple(actual.shape), tuple(golden.shape)
    if shape != golden_shape:
        inf = math.inf
        failing = golden.numel()
        return OutputStats(
            name, shape, golden_shape, inf, inf, inf, inf, inf, inf, 0, failing, False
        )
    actual = actual.detach().to(torch.float64).flatten()
    golden = golden.detach().to(torch.float64).flatten()
    if actual.numel() == 0:
        return OutputStats(name, shape, golden_shape, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, True)

    nonfinite = ~(torch.isfinite(actual) & torch.isfinite(golden))
    abs_err = (actual - golden).abs()
    rel_err = abs_err / golden.abs()
    # NaN compares False, so a non-finite element can never pass either test.
    within = ((abs_err <= atol) | (rel_err <= rtol)) & ~nonfinite
    # An element fails the rtol test when rel > rtol; only atol >= its abs error could pass it.
    rel_fails = ~(rel_err <= rtol) | nonfinite
    needed_atol = 0.0
    if bool(rel_fails.any()):
        needed_atol = math.inf if bool(nonfinite.any()) else abs_err[rel_fails].max().item()

    return OutputStats(
        name=name,
        shape=shape,
        golden_shape=golden_shape,
        max_abs=_nan_as_inf(abs_err.max().item()),
        mean_abs=_nan_as_inf(abs_err.mean().item()),
        max_rel=_nan_as_inf(rel_err.nan_to_num(nan=0.0).max().item()),
        p99_abs=_nan_as_inf(_nearest_rank(abs_err, 0.99)),
        nrmse=_nan_as_inf(_nrmse(abs_err, golden)),
        needed_atol=needed_atol,
        nonfinite=int(nonfinite.sum()),
        failing=int((~within).sum()),
        passed=bool(within.all()),
    )


def _nearest_rank(values: torch.Tensor, quantile: float) -> float:
    # torch.quantile refuses inputs over 16M elements; a sort has no such limit (NaN sorts last).
    return values.sort().values[round(quantile * (values.numel() - 1))].item()


def _nrmse(abs_err: torch.Tensor, golden: torch.Tensor) -> float:
    """Root-mean-square error over the golden's root-mean-square."""
    rmse = abs_err.square().mean().sqrt().item()
    golden_rms = golden.square().mean().sqrt().item()
    if golden_rms > 0:
        return rmse / golden_rms
    return 0.0 if rmse == 0 else math.inf


def _nan_as_inf(value: float) -> float:
    """A statistic over NaN elements is as bad as it gets; inf keeps max() ordering meaningful."""
    return math.inf if math.isnan(value) else value
