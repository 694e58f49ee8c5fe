"""Comparison of one output against its float64 golden, with the statistics Polygraphy reports."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutputStats:
    """`needed_atol` is the smallest atol that would pass with the same rtol (inf if none would).
    `dtype` is the artifact's, `expected_dtype` eager's at the model's own dtype."""

    name: str
    shape: tuple[int, ...]
    golden_shape: tuple[int, ...]
    dtype: str
    expected_dtype: str
    max_abs: float
    mean_abs: float
    max_rel: float
    p99_abs: float
    nrmse: float
    needed_atol: float
    nonfinite: int
    failing: int
    passed: bool

    @property
    def values_differ(self) -> bool:
        """Whether the values fail, whatever the dtype: elements beyond the tolerances, or
        another shape than the golden's."""
        return self.failing > 0 or self.shape != self.golden_shape


def compare(
    name: str,
    actual: torch.Tensor,
    golden: torch.Tensor,
    expected_dtype: torch.dtype,
    atol: float,
    rtol: float,
) -> OutputStats:
    """An element passes when abs <= atol or rel <= rtol. An infinity passes against the same
    infinity, with error 0 (Polygraphy's infinities_compare_equal); against anything else, and
    NaN on either side, an element never passes. The output's shape must equal the golden's,
    and its dtype must be `expected_dtype`: an artifact that returns float64 where eager gives
    float32 fails however close its values are, which are still measured."""
    dtypes = _dtype_name(actual.dtype), _dtype_name(expected_dtype)
    same_dtype = actual.dtype == expected_dtype
    shape, golden_shape = tuple(actual.shape), tuple(golden.shape)
    if shape != golden_shape:
        inf = math.inf
        failing = golden.numel()
        return OutputStats(
            name, shape, golden_shape, *dtypes, inf, inf, inf, inf, inf, inf, 0, failing, False
        )
    actual = actual.detach().to(torch.float64).flatten()
    golden = golden.detach().to(torch.float64).flatten()
    if actual.numel() == 0:
        zeros = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
        return OutputStats(name, shape, golden_shape, *dtypes, *zeros, same_dtype)

    # inf - inf is NaN: an infinity matched by the same one gets error 0 before any statistic.
    equal_inf = torch.isinf(golden) & (actual == golden)
    nonfinite = ~(torch.isfinite(actual) & torch.isfinite(golden)) & ~equal_inf
    abs_err = (actual - golden).abs().masked_fill(equal_inf, 0.0)
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
        dtype=dtypes[0],
        expected_dtype=dtypes[1],
        max_abs=_nan_as_inf(abs_err.max().item()),
        mean_abs=_nan_as_inf(abs_err.mean().item()),
        max_rel=_nan_as_inf(rel_err.nan_to_num(nan=0.0).max().item()),
        p99_abs=_nan_as_inf(_nearest_rank(abs_err, 0.99)),
        # The matched infinities leave the golden's RMS too, or it would be inf and hide errors.
        nrmse=_nan_as_inf(_nrmse(abs_err, golden.masked_fill(equal_inf, 0.0))),
        needed_atol=needed_atol,
        nonfinite=int(nonfinite.sum()),
        failing=int((~within).sum()),
        passed=bool(within.all()) and same_dtype,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
