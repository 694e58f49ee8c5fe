"""What quantization costs: a quantized model's next-token predictions against the float
model's, as llama.cpp's `perplexity --kl-divergence` reports them.

Per position, the KL divergence KL(float || quantized) of the two next-token distributions (in
nats), whether both predict the same top token, and how much probability the quantized model
takes from the float model's top token; pooled over positions, their mean (KLD's p99 and max
too). On a text, the perplexity of each model and their ratio. Plain tensors in, plain figures
out: the goldens stage measures the quantized model in eager with them, the validate stage the
artifact's own outputs (exporter/quantize/verdict.py judges them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class PerPosition:
    """One value per position of each measure (1-D float64 tensors of equal length)."""

    kld: torch.Tensor
    top1: torch.Tensor
    prob_drop: torch.Tensor

    @classmethod
    def concat(cls, parts: list[PerPosition]) -> PerPosition:
        return cls(
            torch.cat([p.kld for p in parts]),
            torch.cat([p.top1 for p in parts]),
            torch.cat([p.prob_drop for p in parts]),
        )


@dataclass(frozen=True)
class NextToken:
    """Pooled over `positions` positions: KL(float || quantized) mean, 99th percentile and max
    (nats), the fraction of positions whose top token is the float model's (top-1 agreement),
    and the mean drop in probability of the float model's top token."""

    positions: int
    kld_mean: float
    kld_p99: float
    kld_max: float
    top1: float
    prob_drop: float

    @classmethod
    def of(cls, measured: PerPosition) -> NextToken:
        kld = measured.kld
        return cls(
            positions=int(kld.numel()),
            kld_mean=float(kld.mean()),
            kld_p99=float(torch.quantile(kld, 0.99)),
            kld_max=float(kld.max()),
            top1=float(measured.top1.mean()),
            prob_drop=float(measured.prob_drop.mean()),
        )

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def per_position(float_logits: torch.Tensor, quantized_logits: torch.Tensor) -> PerPosition:
    """The measures at every position of two logits tensors of one shape [..., vocab], in
    float64."""
    if float_logits.shape != quantized_logits.shape:
        raise ValueError(
            f"the float model's logits are {tuple(float_logits.shape)} and the quantized "
            f"model's {tuple(quantized_logits.shape)}: they must match."
        )
    vocab = float_logits.shape[-1]
    log_p = torch.log_softmax(float_logits.detach().reshape(-1, vocab).to(torch.float64), dim=-1)
    log_q = torch.log_softmax(
        quantized_logits.detach().reshape(-1, vocab).to(torch.float64), dim=-1
    )
    p = log_p.exp()
    # p * log p is 0 where p is 0; where q is 0 and p is not, KL is +inf, as it should be.
    kld = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(dim=-1)
    top = log_p.argmax(dim=-1, keepdim=True)
    top1 = (log_q.argmax(dim=-1, keepdim=True) == top).to(torch.float64).squeeze(-1)
    prob_drop = (p.gather(-1, top) - log_q.exp().gather(-1, top)).squeeze(-1)
    return PerPosition(kld.clamp(min=0), top1, prob_drop)


def next_token(float_logits: torch.Tensor, quantized_logits: torch.Tensor) -> NextToken:
    """The measures pooled over every position of two logits tensors of one shape."""
    return NextToken.of(per_position(float_logits, quantized_logits))


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood of tokens[1:] under logits[:-1]: logits
    [n, vocab] of a causal LM fed `tokens` [n]."""
    log_probs = torch.log_softmax(logits[:-1].to(torch.float64), dim=-1)
    nll = -log_probs.gather(-1, tokens[1:].unsqueeze(-1)).mean()
    return math.exp(float(nll))


@dataclass(frozen=True)
class Perplexity:
    """Both models' perplexity on one text, `tokens` long, and the quantized over the float."""

    text: str
    tokens: int
    float: float
    quantized: float

    @property
    def ratio(self) -> float:
        return self.quantized / self.float

    def to_json(self) -> dict[str, object]:
        return asdict(self) | {"ratio": self.ratio}


def text() -> tuple[str, str]:
    """The natural English text that perplexity is measured on, and where it comes from: the
    Python documentation's section on exceptions, as the standard library ships it (no file to
    fetch, the same wherever the job runs)."""
    from pydoc_data.topics import topics

    return "pydoc_data.topics['exceptions']", topics["exceptions"]
