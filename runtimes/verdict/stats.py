"""The rule an output is judged under and what judging it measures, as plain values: the job's
tolerances, eager's error that the reference rule scales, what next-token logits predict, and
one output's statistics. No torch: the exporter's command reads a report (runtimes/verdict/
report.py) into these without loading it; runtimes/verdict/compare.py computes them."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EagerError:
    """The error of eager PyTorch at the model's dtype against the float64 oracle, for one
    output at one shape: what the model's own precision costs."""

    max_abs: float
    nrmse: float
    # For an output of next-token logits, eager's predictions against the oracle's (NextToken).
    top1: float = math.nan
    kl_mean: float = math.nan
    kl_max: float = math.nan


@dataclass(frozen=True)
class NextToken:
    """What next-token logits predict, against the float64 oracle's, over every position: the
    fraction whose most likely token is the oracle's (top-1 agreement), and the KL divergence
    KL(oracle || artifact) of the next-token distributions, in nats, their mean and largest
    (llama.cpp's perplexity --kl-divergence)."""

    top1: float
    kl_mean: float
    kl_max: float


@dataclass(frozen=True)
class Tolerances:
    """The job's rule and its settings: `rule` is "reference" or "absolute" (ValidationRule).
    `half` is the reference rule's verdict on an output of next-token logits at a half dtype
    (HalfRule): "strict", the numbers alone, or "distribution", which also passes one whose
    numbers fail when its predictions are eager's: top-1 agreement with the oracle at least
    eager's less `top1_slack`, and mean KL divergence at most `kl_factor` times eager's."""

    rule: str
    atol: float
    rtol: float
    factor: float
    floor: float
    half: str = "strict"
    kl_factor: float = math.nan
    top1_slack: float = 0.0

    @classmethod
    def absolute(cls, atol: float, rtol: float) -> Tolerances:
        """The absolute rule alone, with nothing of the reference rule's."""
        return cls("absolute", atol, rtol, factor=math.nan, floor=0.0)

    @property
    def scaled(self) -> bool:
        return self.rule == "reference"

    @property
    def by_distribution(self) -> bool:
        return self.scaled and self.half == "distribution"

    def describe(self) -> str:
        if self.rule == "reference":
            described = f"rule=reference factor={self.factor:g} floor={self.floor:g}"
            if self.by_distribution:
                described += (
                    f" half=distribution kl_factor={self.kl_factor:g} "
                    f"top1_slack={self.top1_slack:g}"
                )
            return described
        return f"rule=absolute atol={self.atol:g} rtol={self.rtol:g}"


@dataclass(frozen=True)
class OutputStats:
    """`needed_atol` is the smallest atol that would pass with the same rtol (inf if none would).
    `dtype` is the artifact's, `expected_dtype` eager's at the model's own dtype. `ref_*` are
    eager's errors at that dtype where the job measured them (NaN otherwise); `ratio` is the
    larger of nrmse/ref_nrmse and max_abs/ref_max_abs, and `needed_factor` the smallest factor
    the reference rule would pass with the job's floor. `within`: the values pass the job's
    rule. For next-token logits, `top1`, `kl_mean` and `kl_max` are the artifact's predictions
    against the oracle's (NextToken) and `ref_*` eager's; `by_distribution`: the numbers failed
    and the half-precision distribution rule passed them (Tolerances)."""

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
    top1: float = math.nan
    ref_top1: float = math.nan
    kl_mean: float = math.nan
    ref_kl_mean: float = math.nan
    kl_max: float = math.nan
    ref_kl_max: float = math.nan
    by_distribution: bool = False

    @property
    def values_differ(self) -> bool:
        """Whether the values fail, whatever the dtype: beyond the rule, or another shape than
        the golden's."""
        return not self.within
