"""Comparison of one output against its float64 golden, with the statistics Polygraphy reports."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EagerError:
    """The error of eager PyTorch at the model's dtype against the float64 oracle, for one
    output at one shape: what the model's own precision costs."""

    max_abs: float
    nrmse: float


@dataclass(frozen=True)
class Tolerances:
    """The job's rule and its settings: `rule` is "reference" or "absolute" (ValidationRule)."""

    rule: str
    atol: float
    rtol: float
    factor: float
    floor: float

    @property
    def scaled(self) -> bool:
        return self.rule == "reference"

    def describe(self) -> str:
        if self.rule == "reference":
            return f"rule=reference factor={self.factor:g} floor={self.floor:g}"
        return f"rule=absolute atol={self.atol:g} rtol={self.rtol:g}"


@dataclass(frozen=True)
class OutputStats:
    """`needed_atol` is the smallest atol that would pass with the same rtol (inf if none would).
    `dtype` is the artifact's, `expected_dtype` eager's at the model's own dtype. `ref_*` are
    eager's errors at that dtype where the job measured them (NaN otherwise); `ratio` is the
    larger of nrmse/ref_nrmse and max_abs/ref_max_abs, and `needed_factor` the smallest factor
    the reference rule would pass with the job's floor. `within`: the values pass the job's
    rule."""

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
    within: bool
    passed: bool
    ref_max_abs: float = math.nan
    ref_nrmse: float = math.nan
    ratio: float = math.nan
    needed_factor: float = math.nan

    @property
    def values_differ(self) -> bool:
        """Whether the values fail, whatever the dtype: beyond the rule, or another shape than
        the golden's."""
        return not self.within


def compare(
    name: str,
    actual: torch.Tensor,
    golden: torch.Tensor,
    expected_dtype: torch.dtype,
    atol: float,
    rtol: float,
    reference: EagerError | None = None,
    factor: float | None = None,
    floor: float = 0.0,
) -> OutputStats:
    """Under the absolute rule (`factor` None) an element passes when abs <= atol or rel <= rtol.
    Under the reference rule the output passes as a whole when its RMS error and its max abs
    error are each at most `factor` times `reference`'s plus `floor` times the golden's RMS (for
    the RMS error) or its largest magnitude (for the max abs error),
    and `failing` counts the elements beyond the max abs bound. `reference` is reported under
    either rule. An infinity passes against the same infinity, with
    error 0 (Polygraphy's infinities_compare_equal); against anything else, and NaN on either
    side, an element never passes. The output's shape must equal the golden's, and its dtype
    must be `expected_dtype`: an artifact that returns float64 where eager gives float32 fails
    however close its values are, which are still measured."""
    dtypes = _dtype_name(actual.dtype), _dtype_name(expected_dtype)
    same_dtype = actual.dtype == expected_dtype
    shape, golden_shape = tuple(actual.shape), tuple(golden.shape)
    if factor is not None and reference is None:
        raise ValueError("the reference rule needs eager's error at the model's dtype")
    ref = {"ref_max_abs": reference.max_abs, "ref_nrmse": reference.nrmse} if reference else {}
    if shape != golden_shape:
        inf = math.inf
        failing = golden.numel()
        return OutputStats(
            name, shape, golden_shape, *dtypes, inf, inf, inf, inf, inf, inf, 0, failing,
            False, False, **ref, ratio=inf, needed_factor=inf,
        )  # fmt: skip
    actual = actual.detach().to(torch.float64).flatten()
    golden = golden.detach().to(torch.float64).flatten()
    if actual.numel() == 0:
        zeros = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
        return OutputStats(
            name, shape, golden_shape, *dtypes, *zeros, True, same_dtype, **ref,
            ratio=0.0, needed_factor=0.0,
        )  # fmt: skip

    # inf - inf is NaN: an infinity matched by the same one gets error 0 before any statistic.
    equal_inf = torch.isinf(golden) & (actual == golden)
    nonfinite = ~(torch.isfinite(actual) & torch.isfinite(golden)) & ~equal_inf
    abs_err = (actual - golden).abs().masked_fill(equal_inf, 0.0)
    rel_err = abs_err / golden.abs()
    # An element fails the rtol test when rel > rtol; only atol >= its abs error could pass it.
    rel_fails = ~(rel_err <= rtol) | nonfinite
    needed_atol = 0.0
    if bool(rel_fails.any()):
        needed_atol = math.inf if bool(nonfinite.any()) else abs_err[rel_fails].max().item()
    # The matched infinities leave the golden's RMS too, or it would be inf and hide errors.
    finite_golden = golden.masked_fill(equal_inf, 0.0)
    max_abs = _nan_as_inf(abs_err.max().item())
    nrmse = _nan_as_inf(_nrmse(abs_err, finite_golden))

    golden_max = finite_golden.abs().max().item()
    if factor is None:
        # NaN compares False, so a non-finite element can never pass either test.
        element_ok = ((abs_err <= atol) | (rel_err <= rtol)) & ~nonfinite
        failing = int((~element_ok).sum())
        within = failing == 0
    else:
        assert reference is not None
        max_bound = factor * reference.max_abs + floor * golden_max
        failing = int((~(abs_err <= max_bound) | nonfinite).sum())
        within = failing == 0 and nrmse <= factor * reference.nrmse + floor
    if reference is not None:
        ref |= {
            "ratio": max(_ratio(nrmse, reference.nrmse), _ratio(max_abs, reference.max_abs)),
            "needed_factor": max(
                _ratio(nrmse - floor, reference.nrmse),
                _ratio(max_abs - floor * golden_max, reference.max_abs),
            ),
        }

    return OutputStats(
        name=name,
        shape=shape,
        golden_shape=golden_shape,
        dtype=dtypes[0],
        expected_dtype=dtypes[1],
        max_abs=max_abs,
        mean_abs=_nan_as_inf(abs_err.mean().item()),
        max_rel=_nan_as_inf(rel_err.nan_to_num(nan=0.0).max().item()),
        p99_abs=_nan_as_inf(_nearest_rank(abs_err, 0.99)),
        nrmse=nrmse,
        needed_atol=needed_atol,
        nonfinite=int(nonfinite.sum()),
        failing=failing,
        within=within,
        passed=within and same_dtype,
        **ref,
    )


def reference_error(actual: torch.Tensor, golden: torch.Tensor) -> EagerError:
    """Eager's error at the model's dtype, measured as the reference rule reads it."""
    stats = compare("reference", actual, golden, actual.dtype, atol=0.0, rtol=0.0)
    return EagerError(stats.max_abs, stats.nrmse)


def _ratio(error: float, reference: float) -> float:
    """error / reference; an error of 0 (or below the floor) needs no factor, and any other
    over a reference of 0 none would pass."""
    if error <= 0:
        return 0.0
    return error / reference if reference > 0 else math.inf


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
