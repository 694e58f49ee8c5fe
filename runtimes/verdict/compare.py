"""Comparison of one output against its float64 golden, with the statistics Polygraphy reports
(runtimes/verdict/stats.py holds what it returns)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtimes.verdict.stats import EagerError, NextToken, OutputStats, Tolerances

# The model dtypes whose verdict `Tolerances.half` sets, by the name OutputStats gives them.
HALF_DTYPES = ("float16", "bfloat16")


def compare(
    name: str,
    actual: torch.Tensor,
    golden: torch.Tensor,
    expected_dtype: torch.dtype,
    tolerances: Tolerances,
    reference: EagerError | None = None,
    logits: bool = False,
) -> OutputStats:
    """`actual` against its float64 `golden` under `tolerances`' rule: the absolute rule
    (_absolute) or the reference rule (_scaled), which needs `reference`, eager's error at the
    model's dtype; `reference` is reported under either rule. An infinity passes against the
    same infinity, with error 0 (Polygraphy's infinities_compare_equal); against anything else,
    and NaN on either side, an element never passes. The output's shape must equal the golden's,
    and its dtype must be `expected_dtype`: an artifact that returns float64 where eager gives
    float32 fails however close its values are, which are still measured.

    For `logits` (next-token logits on the last axis), what they predict is measured too
    (NextToken); under the half rule "distribution", an output at a half dtype whose values fail
    the reference rule passes where its predictions are as good as eager's (_as_good_as_eager).
    """
    dtypes = _dtype_name(actual.dtype), _dtype_name(expected_dtype)
    same_dtype = actual.dtype == expected_dtype
    shape, golden_shape = tuple(actual.shape), tuple(golden.shape)
    if tolerances.scaled and reference is None:
        raise ValueError("the reference rule needs eager's error at the model's dtype")
    ref = {"ref_max_abs": reference.max_abs, "ref_nrmse": reference.nrmse} if reference else {}
    if shape != golden_shape:
        inf = math.inf
        failing = golden.numel()
        return OutputStats(
            name, shape, golden_shape, *dtypes, inf, inf, inf, inf, inf, inf, 0, failing,
            False, False, **ref, ratio=inf, needed_factor=inf,
        )  # fmt: skip
    predicted = next_token(actual, golden) if logits and golden.numel() else None
    if actual.numel() == 0:
        zeros = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
        return OutputStats(
            name, shape, golden_shape, *dtypes, *zeros, True, same_dtype, **ref,
            ratio=0.0, needed_factor=0.0,
        )  # fmt: skip
    errors = _Errors.of(actual, golden, tolerances.rtol)
    if tolerances.scaled:
        assert reference is not None
        failing, within = _scaled(errors, reference, tolerances.factor, tolerances.floor)
    else:
        failing, within = _absolute(errors, tolerances.atol, tolerances.rtol)
    if reference is not None:
        ref |= _factors(errors, reference, tolerances.floor)
    by_distribution = False
    if predicted is not None:
        ref |= {"top1": predicted.top1, "kl_mean": predicted.kl_mean, "kl_max": predicted.kl_max}
        if reference is not None:
            ref |= {
                "ref_top1": reference.top1,
                "ref_kl_mean": reference.kl_mean,
                "ref_kl_max": reference.kl_max,
            }
            by_distribution = (
                not within
                and dtypes[1] in HALF_DTYPES
                and not errors.any_nonfinite
                and _as_good_as_eager(predicted, reference, tolerances)
            )
    return OutputStats(
        name=name,
        shape=shape,
        golden_shape=golden_shape,
        dtype=dtypes[0],
        expected_dtype=dtypes[1],
        max_abs=errors.max_abs,
        mean_abs=_nan_as_inf(errors.abs_err.mean().item()),
        max_rel=_nan_as_inf(errors.rel_err.nan_to_num(nan=0.0).max().item()),
        p99_abs=_nan_as_inf(_nearest_rank(errors.abs_err, 0.99)),
        nrmse=errors.nrmse,
        needed_atol=errors.needed_atol,
        nonfinite=int(errors.nonfinite.sum()),
        failing=failing,
        within=within or by_distribution,
        passed=(within or by_distribution) and same_dtype,
        by_distribution=by_distribution,
        **ref,
    )


@dataclass(frozen=True)
class _Errors:
    """The element-wise errors of an output against its golden (both flattened, in float64),
    and the statistics both rules read."""

    abs_err: torch.Tensor
    rel_err: torch.Tensor
    # Elements non-finite on either side, but for an infinity matched by the same one.
    nonfinite: torch.Tensor
    # The golden's largest magnitude, its matched infinities left out.
    golden_max: float
    max_abs: float
    nrmse: float
    # The smallest atol that passes every element with the rule's rtol (inf if none would).
    needed_atol: float

    @property
    def any_nonfinite(self) -> bool:
        return bool(self.nonfinite.any())

    @classmethod
    def of(cls, actual: torch.Tensor, golden: torch.Tensor, rtol: float) -> _Errors:
        actual = actual.detach().to(torch.float64).flatten()
        golden = golden.detach().to(torch.float64).flatten()
        # inf - inf is NaN: an infinity matched by the same one gets error 0 before any
        # statistic.
        equal_inf = torch.isinf(golden) & (actual == golden)
        nonfinite = ~(torch.isfinite(actual) & torch.isfinite(golden)) & ~equal_inf
        abs_err = (actual - golden).abs().masked_fill(equal_inf, 0.0)
        rel_err = abs_err / golden.abs()
        # An element fails the rtol test when rel > rtol; only atol >= its abs error could pass
        # it.
        rel_fails = ~(rel_err <= rtol) | nonfinite
        needed_atol = 0.0
        if bool(rel_fails.any()):
            needed_atol = math.inf if bool(nonfinite.any()) else abs_err[rel_fails].max().item()
        # The matched infinities leave the golden's RMS too, or it would be inf and hide errors.
        finite_golden = golden.masked_fill(equal_inf, 0.0)
        return cls(
            abs_err=abs_err,
            rel_err=rel_err,
            nonfinite=nonfinite,
            golden_max=finite_golden.abs().max().item(),
            max_abs=_nan_as_inf(abs_err.max().item()),
            nrmse=_nan_as_inf(_nrmse(abs_err, finite_golden)),
            needed_atol=needed_atol,
        )


def _absolute(errors: _Errors, atol: float, rtol: float) -> tuple[int, bool]:
    """The absolute rule, element by element: an element passes when abs <= atol or rel <= rtol.
    The elements that fail, and whether the output passes (none fails)."""
    # NaN compares False, so a non-finite element can never pass either test.
    element_ok = ((errors.abs_err <= atol) | (errors.rel_err <= rtol)) & ~errors.nonfinite
    failing = int((~element_ok).sum())
    return failing, failing == 0


def _scaled(
    errors: _Errors, reference: EagerError, factor: float, floor: float
) -> tuple[int, bool]:
    """The reference rule, on the output as a whole: it passes when its RMS error and its max
    abs error are each at most `factor` times eager's plus `floor` times the golden's RMS (for
    the RMS error) or its largest magnitude (for the max abs error). The elements beyond the max
    abs bound fail."""
    max_bound = factor * reference.max_abs + floor * errors.golden_max
    failing = int((~(errors.abs_err <= max_bound) | errors.nonfinite).sum())
    return failing, failing == 0 and errors.nrmse <= factor * reference.nrmse + floor


def _factors(errors: _Errors, reference: EagerError, floor: float) -> dict[str, float]:
    """The output's errors over eager's (`ratio`), and the smallest factor the reference rule
    would pass with `floor` (`needed_factor`)."""
    return {
        "ratio": max(
            _ratio(errors.nrmse, reference.nrmse), _ratio(errors.max_abs, reference.max_abs)
        ),
        "needed_factor": max(
            _ratio(errors.nrmse - floor, reference.nrmse),
            _ratio(errors.max_abs - floor * errors.golden_max, reference.max_abs),
        ),
    }


def _as_good_as_eager(predicted: NextToken, reference: EagerError, tolerances: Tolerances) -> bool:
    """The half rule "distribution": next-token predictions that agree with the oracle's at
    least as often as eager's, less `top1_slack`, and diverge from them by at most `kl_factor`
    times eager's mean KL divergence."""
    return (
        tolerances.by_distribution
        and predicted.top1 >= reference.top1 - tolerances.top1_slack
        and predicted.kl_mean <= tolerances.kl_factor * reference.kl_mean
    )


def next_token(logits: torch.Tensor, golden: torch.Tensor) -> NextToken:
    """`logits`' predictions against `golden`'s, each position's distribution over the last
    axis; computed in float64. A token the golden gives probability 0 adds nothing to the KL
    divergence; non-finite logits make it infinite."""
    vocab = golden.shape[-1]
    ours = torch.log_softmax(logits.detach().to(torch.float64).reshape(-1, vocab), dim=-1)
    theirs = torch.log_softmax(golden.detach().to(torch.float64).reshape(-1, vocab), dim=-1)
    probability = theirs.exp()
    terms = torch.where(probability > 0, probability * (theirs - ours), 0.0)
    divergence = terms.sum(dim=-1).nan_to_num(nan=math.inf)
    agree = (ours.argmax(dim=-1) == theirs.argmax(dim=-1)).to(torch.float64)
    return NextToken(
        top1=agree.mean().item(),
        kl_mean=_nan_as_inf(divergence.mean().item()),
        kl_max=_nan_as_inf(divergence.max().item()),
    )


def reference_error(actual: torch.Tensor, golden: torch.Tensor, logits: bool = False) -> EagerError:
    """Eager's error at the model's dtype, measured as the reference rule reads it, and for
    `logits` its predictions."""
    stats = compare(
        "reference", actual, golden, actual.dtype, Tolerances.absolute(0.0, 0.0), None, logits
    )
    return EagerError(stats.max_abs, stats.nrmse, stats.top1, stats.kl_mean, stats.kl_max)


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
