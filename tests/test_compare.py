"""The comparison statistics and the pass rule, on outputs whose errors are known exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from runtimes.verdict.compare import compare, next_token, reference_error
from runtimes.verdict.report import Execution, Report, json_safe
from runtimes.verdict.stats import EagerError, NextToken, OutputStats, Tolerances


def test_identical_outputs_pass_with_zero_error() -> None:
    golden = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    stats = compare("y", golden.float(), golden, torch.float32, Tolerances.absolute(0.0, 0.0))
    assert stats.passed
    assert (stats.max_abs, stats.mean_abs, stats.nrmse, stats.needed_atol) == (0, 0, 0, 0)
    assert stats.failing == 0


def test_statistics_of_a_known_error() -> None:
    golden = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    actual = torch.tensor([1.0, 2.0, 3.0, 4.1], dtype=torch.float64)
    stats = compare("y", actual, golden, torch.float64, Tolerances.absolute(0.01, 0.01))
    assert stats.max_abs == pytest.approx(0.1)
    assert stats.mean_abs == pytest.approx(0.025)
    assert stats.max_rel == pytest.approx(0.025)
    assert stats.nrmse == pytest.approx(math.sqrt(0.01 / 4) / math.sqrt(30 / 4))
    assert stats.p99_abs == pytest.approx(0.1)
    assert not stats.passed
    assert stats.failing == 1
    # rel 0.025 > rtol, so only an atol of at least 0.1 passes that element.
    assert stats.needed_atol == pytest.approx(0.1)
    assert compare(
        "y", actual, golden, torch.float64, Tolerances.absolute(stats.needed_atol, 0.01)
    ).passed


def test_an_element_passes_on_rtol_alone() -> None:
    golden = torch.tensor([1000.0], dtype=torch.float64)
    stats = compare(
        "y", torch.tensor([1000.5]), golden, torch.float32, Tolerances.absolute(0.1, 1e-3)
    )
    assert stats.passed
    assert stats.needed_atol == 0


def test_an_infinity_passes_against_the_same_infinity_with_zero_error() -> None:
    golden = torch.tensor([1.0, math.inf, -math.inf, 4.0], dtype=torch.float64)
    actual = torch.tensor([1.0, math.inf, -math.inf, 4.5])
    stats = compare("y", actual, golden, torch.float32, Tolerances.absolute(0.0, 0.0))
    # Only the 0.5 at the last element is an error; the infinities contribute 0.
    assert (stats.max_abs, stats.mean_abs) == (0.5, 0.125)
    assert stats.nrmse == pytest.approx(math.sqrt(0.25 / 4) / math.sqrt(17 / 4))
    assert (stats.nonfinite, stats.failing, stats.needed_atol) == (0, 1, 0.5)
    assert not stats.passed
    assert compare("y", actual, golden, torch.float32, Tolerances.absolute(0.5, 0.0)).passed
    same = compare("y", golden.float(), golden, torch.float32, Tolerances.absolute(0.0, 0.0))
    assert same.passed
    assert (same.max_abs, same.max_rel, same.p99_abs, same.nrmse) == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("actual", "golden"),
    [
        ([math.inf, 2.0], [1.0, 2.0]),
        ([1.0, 2.0], [math.inf, 2.0]),
        ([-math.inf, 2.0], [math.inf, 2.0]),
        ([math.inf, 2.0], [-math.inf, 2.0]),
        ([math.nan, 2.0], [1.0, 2.0]),
        ([1.0, 2.0], [math.nan, 2.0]),
        ([math.nan, 2.0], [math.nan, 2.0]),
    ],
    ids=[
        "inf-vs-finite",
        "finite-vs-inf",
        "-inf-vs-inf",
        "inf-vs--inf",
        "nan",
        "nan-golden",
        "nan-both",
    ],
)
def test_a_nonfinite_element_fails_unless_it_is_the_same_infinity(
    actual: list[float], golden: list[float]
) -> None:
    stats = compare(
        "y",
        torch.tensor(actual),
        torch.tensor(golden, dtype=torch.float64),
        torch.float32,
        Tolerances.absolute(1e9, 1e9),
    )
    assert not stats.passed
    assert (stats.nonfinite, stats.failing) == (1, 1)
    assert stats.max_abs == math.inf
    assert stats.needed_atol == math.inf


def test_an_output_of_another_dtype_fails_however_close_its_values() -> None:
    golden = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    stats = compare("y", golden.clone(), golden, torch.float32, Tolerances.absolute(1e-3, 1e-3))
    assert not stats.passed
    assert (stats.dtype, stats.expected_dtype) == ("float64", "float32")
    # The values are still measured, and they match.
    assert (stats.max_abs, stats.failing, stats.needed_atol) == (0, 0, 0)
    assert not stats.values_differ
    right = compare("y", golden.float(), golden, torch.float32, Tolerances.absolute(1e-3, 1e-3))
    assert right.passed
    assert (right.dtype, right.expected_dtype) == ("float32", "float32")


def test_a_shape_that_differs_from_eager_fails() -> None:
    golden = torch.zeros(1, 5, 8, dtype=torch.float64)
    stats = compare(
        "logits", torch.zeros(1, 4, 8), golden, torch.float32, Tolerances.absolute(1.0, 1.0)
    )
    assert not stats.passed
    assert stats.shape == (1, 4, 8)
    assert stats.golden_shape == (1, 5, 8)


def test_p99_is_the_nearest_rank() -> None:
    golden = torch.zeros(101, dtype=torch.float64)
    actual = torch.arange(101, dtype=torch.float64)
    assert compare("y", actual, golden, torch.float64, Tolerances.absolute(0, 0)).p99_abs == 99.0


def report_of(*outputs: OutputStats) -> Report:
    shape = {"seq": 4}
    tolerances = Tolerances("absolute", atol=0.0, rtol=0.0, factor=2.0, floor=0.0)
    return Report(
        tolerances, ("y", "z"), (shape,), (Execution(shape, "same instance", 1.0, outputs),)
    )


def test_the_failure_message_names_a_wrong_dtype_without_an_atol_that_cannot_fix_it() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    wrong = compare("y", golden.clone(), golden, torch.float32, Tolerances.absolute(0.0, 0.0))
    right = compare("z", golden.float(), golden, torch.float32, Tolerances.absolute(0.0, 0.0))
    report = report_of(wrong, right)
    assert not report.passed
    assert report.failure_message() == "output y is float64 where eager gives float32."


def test_the_failure_message_gives_the_dtype_and_the_values_that_differ() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    wrong = compare("y", golden.clone(), golden, torch.float32, Tolerances.absolute(0.0, 0.0))
    off = compare(
        "z", torch.tensor([1.0, 2.5]), golden, torch.float32, Tolerances.absolute(0.0, 0.0)
    )
    assert report_of(wrong, off).failure_message() == (
        "output y is float64 where eager gives float32. 1 of 1 live shapes differ from eager "
        "beyond rule=absolute atol=0 rtol=0: seq=4 (max_abs 0.5). The smallest atol that would "
        "pass them all is 0.5."
    )


def test_the_reference_rule_scales_with_eagers_error_and_names_the_factor_that_would_pass() -> None:
    golden = torch.linspace(-4, 4, 1000, dtype=torch.float64)
    noise = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    eager = golden + 1e-3 * noise
    reference = compare("y", eager, golden, torch.float64, Tolerances.absolute(0.0, 0.0))
    eager_error = EagerError(reference.max_abs, reference.nrmse)
    # As precise as eager, with other roundings: passes where atol=1e-4 would fail it.
    other = golden + 1e-3 * noise.flip(0)
    passed = compare(
        "y",
        other,
        golden,
        torch.float64,
        Tolerances("reference", 1e-4, 0.0, 1.5, 1e-6),
        eager_error,
    )
    assert passed.passed and passed.ratio == pytest.approx(1.0)
    assert not compare(
        "y", other, golden, torch.float64, Tolerances.absolute(1e-4, 0.0), eager_error
    ).passed
    # 1% off everywhere: many times eager's error, and the message-worthy factor says how many.
    scaled = compare(
        "y",
        golden * 1.01,
        golden,
        torch.float64,
        Tolerances("reference", 1e-4, 0.0, 1.5, 0.0),
        eager_error,
    )
    assert not scaled.passed and scaled.failing > 0
    assert scaled.ratio == pytest.approx(scaled.needed_factor) and scaled.ratio > 10
    assert scaled.ref_nrmse == pytest.approx(eager_error.nrmse)


def test_the_reference_rule_fails_one_wild_element_and_nan_but_its_floor_passes_exact_ties() -> (
    None
):
    golden = torch.linspace(1, 2, 1000, dtype=torch.float64)
    eager_error = EagerError(max_abs=1e-3, nrmse=5e-4)
    wild = golden.clone()
    wild[7] += 0.01
    stats = compare(
        "y", wild, golden, torch.float64, Tolerances("reference", 0.0, 0.0, 1.5, 0.0), eager_error
    )
    assert (stats.passed, stats.failing) == (False, 1)
    nan = golden.clone()
    nan[3] = math.nan
    assert not compare(
        "y", nan, golden, torch.float64, Tolerances("reference", 0.0, 0.0, 1.5, 0.0), eager_error
    ).passed
    exact = EagerError(0.0, 0.0)
    tiny = golden + 1e-9
    assert compare(
        "y", tiny, golden, torch.float64, Tolerances("reference", 0.0, 0.0, 1.5, 1e-6), exact
    ).passed
    assert not compare(
        "y", tiny, golden, torch.float64, Tolerances("reference", 0.0, 0.0, 1.5, 0.0), exact
    ).passed


def test_the_reference_rules_failure_message_gives_both_errors_and_the_factor() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    eager_error = EagerError(max_abs=0.1, nrmse=0.05)
    off = compare(
        "y",
        torch.tensor([1.0, 2.5]),
        golden,
        torch.float32,
        Tolerances("reference", 0.0, 0.0, 2.0, 0.0),
        eager_error,
    )
    tolerances = Tolerances("reference", atol=0.0, rtol=0.0, factor=2.0, floor=0.0)
    shape = {"seq": 4}
    report = Report(tolerances, ("y",), (shape,), (Execution(shape, "same instance", 1.0, (off,)),))
    assert report.failure_message() == (
        "1 of 1 live shapes are less accurate than eager at the model's dtype beyond "
        "rule=reference factor=2 floor=0: seq=4 (nrmse 0.224, eager 0.05; max_abs 0.5, eager "
        "0.1). The smallest validate.factor that would pass them all is 5."
    )


def test_a_report_read_back_from_its_json_is_the_same_report_infinities_and_nan_included() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    off = compare(
        "y", torch.tensor([1.0, math.nan]), golden, torch.float32, Tolerances.absolute(0.0, 0.0)
    )
    unmeasured = compare("z", torch.zeros(3), golden, torch.float32, Tolerances.absolute(0.0, 0.0))
    report = report_of(off, unmeasured)
    payload = json.loads(json.dumps(json_safe(report.to_json())))

    again = Report.from_json(payload)

    assert json_safe(again.to_json()) == payload
    assert again.executions[0].outputs[1].golden_shape == (2,)
    assert math.isinf(again.executions[0].outputs[0].max_abs)
    assert math.isnan(again.executions[0].outputs[0].ref_nrmse)
    assert again.table() == report.table()


def test_next_token_agreement_and_kl_divergence_of_known_logits() -> None:
    golden = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]]], dtype=torch.float64)
    # The first position's top token moves from 0 to 1; the second keeps its own.
    actual = torch.tensor([[[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]]])
    predicted = next_token(actual, golden)
    p = torch.softmax(golden[0, 0], dim=0)
    q = torch.softmax(actual[0, 0].double(), dim=0)
    first = float((p * (p / q).log()).sum())
    assert predicted.top1 == 0.5
    assert predicted.kl_mean == pytest.approx(first / 2, rel=1e-12)
    assert predicted.kl_max == pytest.approx(first, rel=1e-12)
    assert next_token(golden, golden) == NextToken(1.0, 0.0, 0.0)
    nan = actual.clone()
    nan[0, 1, 2] = math.nan
    assert next_token(nan, golden).kl_max == math.inf


def _half_logits() -> tuple[torch.Tensor, torch.Tensor, EagerError]:
    """Peaked logits over 50 tokens at 64 positions, and eager float16's rounding of them."""
    generator = torch.Generator().manual_seed(0)
    golden = 4 * torch.randn(1, 64, 50, dtype=torch.float64, generator=generator)
    eager = golden.to(torch.float16)
    return golden, eager, reference_error(eager, golden, logits=True)


def test_the_half_rule_passes_logits_that_predict_as_eager_does_and_strict_fails_them() -> None:
    golden, eager, reference = _half_logits()
    assert reference.top1 == 1.0 and 0 < reference.kl_mean < 1e-5
    # Three times eager's rounding, as a half-precision attention adds: beyond the factor.
    noise = torch.randn(golden.shape, dtype=torch.float64, generator=torch.Generator())
    noisy = (golden + 3 * (eager.double() - golden).abs().mean() * noise).to(torch.float16)
    distribution = Tolerances("reference", 0.0, 0.0, 1.5, 0.0, "distribution", 8.0, 0.0)
    strict = Tolerances("reference", 0.0, 0.0, 1.5, 0.0, "strict", 8.0, 0.0)

    def judged(actual: torch.Tensor, tolerances: Tolerances, dtype: torch.dtype) -> OutputStats:
        return compare("logits", actual, golden, dtype, tolerances, reference, logits=True)

    passed = judged(noisy, distribution, torch.float16)
    assert passed.ratio > 1.5 and passed.top1 == 1.0
    assert passed.kl_mean <= 8 * reference.kl_mean
    assert passed.passed and passed.by_distribution
    assert not judged(noisy, strict, torch.float16).passed
    # A float32 model's logits are judged by their values alone.
    assert not judged(noisy.float(), distribution, torch.float32).passed
    # A top token moved, or a KL divergence beyond the factor, fails.
    moved = noisy.clone()
    moved[0, 5] = golden[0, 5].flip(0).to(torch.float16)
    assert not judged(moved, distribution, torch.float16).passed
    warm = (golden * 1.05).to(torch.float16)
    assert judged(warm, distribution, torch.float16).top1 == 1.0
    assert not judged(warm, distribution, torch.float16).passed
