"""Quality, the measures: KL divergence, top-1 agreement, probability drop and perplexity against
direct computations on known distributions."""

from __future__ import annotations

import math

import pytest
import torch

from exporter.quantize import quality


def logits_of(*probabilities: list[float]) -> torch.Tensor:
    return torch.tensor(probabilities, dtype=torch.float64).log()


def test_the_kl_divergence_top1_and_drop_of_two_known_distributions() -> None:
    float_logits = logits_of([0.7, 0.3], [0.5, 0.5 - 1e-9])
    quantized_logits = logits_of([0.4, 0.6], [0.5, 0.5 - 1e-9])
    measured = quality.next_token(float_logits, quantized_logits)
    first = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
    assert measured.positions == 2
    assert measured.kld_mean == pytest.approx(first / 2, rel=1e-12)
    assert measured.kld_max == pytest.approx(first, rel=1e-12)
    # Its top token moved at the first position only; the float top token lost 0.3 there.
    assert measured.top1 == 0.5
    assert measured.prob_drop == pytest.approx(0.3 / 2, rel=1e-9)


def test_the_p99_is_the_99th_percentile_over_positions() -> None:
    # 100 positions: 99 equal, one far off; p99 lies between them, max is the far one.
    uniform = torch.zeros(100, 4, dtype=torch.float64)
    moved = uniform.clone()
    moved[37] = torch.tensor([5.0, 0.0, 0.0, 0.0])
    per = quality.per_position(uniform, moved)
    far = float(per.kld[37])
    measured = quality.NextToken.of(per)
    assert far > 0.5 and measured.kld_max == pytest.approx(far)
    assert measured.kld_p99 == pytest.approx(0.01 * far)
    assert measured.kld_mean == pytest.approx(far / 100)


def test_logits_of_any_leading_shape_pool_their_positions_and_must_match() -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(2, 5, 11, generator=generator)
    assert quality.next_token(a, a).positions == 10
    assert quality.next_token(a, a).kld_max == pytest.approx(0.0, abs=1e-12)
    assert quality.next_token(a, a).top1 == 1.0
    with pytest.raises(ValueError, match=r"\(2, 5, 11\).*\(2, 4, 11\)"):
        quality.next_token(a, a[:, :4])


def test_the_perplexity_of_a_known_model() -> None:
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    # Uniform over 10 tokens: perplexity 10.
    assert quality.perplexity(torch.zeros(8, 10), tokens) == pytest.approx(10.0)
    # Probability 1/2 on each next token, the rest spread evenly: perplexity 2.
    logits = torch.full((8, 10), math.log(0.5 / 9))
    logits[torch.arange(7), tokens[1:]] = math.log(0.5)
    assert quality.perplexity(logits, tokens) == pytest.approx(2.0)
