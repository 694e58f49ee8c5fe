"""The comparison statistics and the pass rule, on outputs whose errors are known exactly."""

from __future__ import annotations

import math

import pytest
import torch

from exporter.validate.compare import compare


def test_identical_outputs_pass_with_zero_error() -> None:
    golden = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    stats = compare("y", golden.float(), golden, atol=0.0, rtol=0.0)
    assert stats.passed
    assert (stats.max_abs, stats.mean_abs, stats.nrmse, stats.needed_atol) == (0, 0, 0, 0)
    assert stats.failing == 0


def test_statistics_of_a_known_error() -> None:
    golden = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    actual = torch.tensor([1.0, 2.0, 3.0, 4.1], dtype=torch.float64)
    stats = compare("y", actual, golden, atol=0.01, rtol=0.01)
    assert stats.max_abs == pytest.approx(0.1)
    assert stats.mean_abs == pytest.approx(0.025)
    assert stats.max_rel == pytest.approx(0.025)
    assert stats.nrmse == pytest.approx(math.sqrt(0.01 / 4) / math.sqrt(30 / 4))
    assert stats.p99_abs == pytest.approx(0.1)
    assert not stats.passed
    assert stats.failing == 1
    # rel 0.025 > rtol, so only an atol of at least 0.1 passes that element.
    assert stats.needed_atol == pytest.approx(0.1)
    assert compare("y", actual, golden, atol=stats.needed_atol, rtol=0.01).passed


def test_an_element_passes_on_rtol_alone() -> None:
    golden = torch.tensor([1000.0], dtype=torch.float64)
    stats = compare("y", torch.tensor([1000.5]), golden, atol=0.1, rtol=1e-3)
    assert stats.passed
    assert stats.needed_atol == 0


def test_nan_and_inf_never_pass() -> None:
    golden = torch.tensor([1.0, math.inf], dtype=torch.float64)
    for actual in (torch.tensor([math.nan, math.inf]), torch.tensor([1.0, math.inf])):
        stats = compare("y", actual, golden, atol=1e9, rtol=1e9)
        assert not stats.passed
        assert stats.nonfinite >= 1
        assert stats.needed_atol == math.inf


def test_a_shape_that_differs_from_eager_fails() -> None:
    golden = torch.zeros(1, 5, 8, dtype=torch.float64)
    stats = compare("logits", torch.zeros(1, 4, 8), golden, atol=1.0, rtol=1.0)
    assert not stats.passed
    assert stats.shape == (1, 4, 8)
    assert stats.golden_shape == (1, 5, 8)


def test_p99_is_the_nearest_rank() -> None:
    golden = torch.zeros(101, dtype=torch.float64)
    actual = torch.arange(101, dtype=torch.float64)
    assert compare("y", actual, golden, atol=0, rtol=0).p99_abs == 99.0
