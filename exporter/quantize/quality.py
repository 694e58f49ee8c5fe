"""What quantization costs: a quantized model's next-token predictions against the float
model's, as llama.cpp's `perplexity --kl-divergence` reports them.

Per position, the KL divergence KL(float || quantized) of the two next-token distributions (in
nats), whether both predict the same top token, and how much probability the quantized model
takes from the float model's top token; pooled over positions, their mean (KLD's p99 and max
too), and perplexity. Plain tensors in, plain figures out: the goldens stage measures the
quantized model in eager with them, the validate stage the artifact's own outputs
(exporter/quantize/verdict.py judges them). And what they are measured on: rows of text through
the checkpoint's tokenizer (Python's documentation by default), or random token ids for a model
without one, and what runs a model on them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from exporter.errors import ConfigError
from exporter.models.bundle import ModelBundle

log = logging.getLogger(__name__)


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


# The sections of Python's documentation (pydoc_data.topics, shipped with Python: nothing to
# fetch, the same text wherever the job runs) that quality is measured on by default: English
# prose about code, a row of each.
DEFAULT_TOPICS = ("exceptions", "assignment", "for", "with", "import")
# Rows of a text file at most: its first ROWS * length tokens.
ROWS = 5
# A row's tokens at most: llama.cpp's perplexity tool judges chunks of a few hundred.
ROW_TOKENS = 128


class NotACausalLm(ConfigError):
    """The model takes no token ids to next-token logits, so there is no text to measure it on."""


@dataclass(frozen=True)
class EvalText:
    """The token rows quality is measured on, each `length` tokens, and where they come from."""

    source: str
    rows: tuple[torch.Tensor, ...]

    @property
    def positions(self) -> int:
        return sum(int(row.numel()) for row in self.rows)


def eval_text(tokenizer: Any, length: int, path: str | None = None) -> EvalText:
    """Rows of `length` tokens: the first of each default topic of Python's documentation, or
    consecutive ones of the UTF-8 file `path` (at most ROWS)."""
    if path is None:
        from pydoc_data.topics import topics

        passages = [topics[name] for name in DEFAULT_TOPICS]
        rows = [_ids(tokenizer, passage)[:length] for passage in passages]
        source = f"Python's documentation (pydoc_data.topics: {', '.join(DEFAULT_TOPICS)})"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(
                f"quantize.eval_text={path}: cannot read it as UTF-8 text: {error}"
            ) from error
        ids = _ids(tokenizer, text)
        rows = [ids[start : start + length] for start in range(0, len(ids), length)][:ROWS]
        source = f"quantize.eval_text={path}"
    rows = [row for row in rows if len(row) >= 2]
    if not rows:
        raise ConfigError(f"{source}: fewer than two tokens of text to measure quality on.")
    return EvalText(source, tuple(torch.tensor(row, dtype=torch.long) for row in rows))


def eval_rows(bundle: ModelBundle, path: str | None, seed: int) -> tuple[EvalText, bool]:
    """What a quantized model's quality is measured on, and whether it is text: rows of the
    checkpoint's tokenizer's text, each at most ROW_TOKENS (and the cache's slots) long; for a
    model without a tokenizer, ROWS rows of random token ids, as its validation inputs are."""
    seq = next((dim for dim in bundle.dims if dim.name == "seq"), None)
    if seq is None or not bundle.logits_outputs or len(bundle.dims) != 1:
        raise NotACausalLm(
            f"quantize=auto plans a causal LM (token ids [1, seq] -> next-token logits) by what "
            f"quantization costs its predictions; model {bundle.name} is none: choose a scheme "
            "(quantize=8da4w, ...)."
        )
    decoder = bundle.decoder
    length = min(ROW_TOKENS, seq.max)
    if decoder is not None:
        length = min(ROW_TOKENS, decoder.max_cache_len)
        if decoder.tokenizer is not None:
            try:
                tokenizer = decoder.tokenizer()
            except ConfigError as error:
                if path is not None:
                    raise
                log.info("[quality] no text to measure on: %s", error)
            else:
                return eval_text(tokenizer, length, path), True
    if path is not None:
        raise ConfigError(
            f"quantize.eval_text={path}: model {bundle.name} has no tokenizer to read it with "
            "(a checkpoint's, with model.kv_cache=static)."
        )
    rows = tuple(
        bundle.make_inputs({"seq": length}, seed + row)[0].reshape(-1) for row in range(ROWS)
    )
    return EvalText(f"{ROWS} rows of {length} random token ids", rows), False


def logits_runner(bundle: ModelBundle) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    """What runs the model on token rows: each row's logits [n, vocab] at the model's dtype, from
    its model without a cache (which shares the layers of the one exported)."""
    module = bundle.decoder.uncached if bundle.decoder else bundle.module
    index = 0 if bundle.decoder else bundle.output_names.index(bundle.logits_outputs[0])

    def run(rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [pytree.tree_leaves(module(row.unsqueeze(0)))[index][0] for row in rows]

    return run


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))
