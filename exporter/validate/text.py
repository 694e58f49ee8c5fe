"""A quantized causal LM's quality where its users see it: on text (exporter/quantize/quality.py's
rows: Python's documentation, or quantize.eval_text), or on random token ids for a model without
a tokenizer.

The goldens keep the float model's float64 logits on every position of the rows, and measure the
quantized model in eager at the model's dtype against them; validation runs the artifact itself
on the same rows (a model with a KV cache: each row a session of its own, half of it a prefill
and the rest decoded a token at a time, as a generation runs) and measures its logits the same
way, with both models' perplexity of the rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from exporter.models import ModelBundle
from exporter.quantize import quality
from exporter.quantize.quality import NextToken, PerPosition, per_position
from exporter.validate.oracle import float64_weights
from runtimes import Loaded
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.sessions import Cache


def goldens(bundle: ModelBundle, eval_text: str | None, seed: int) -> dict[str, Any]:
    """The rows, the float model's float64 logits on them (float32, as the goldens keep a
    half model's), and the quantized model's figures in eager on them; empty for a model that
    is not a causal LM (quantize=auto refuses one; a uniform scheme is measured on its
    validation inputs only)."""
    assert bundle.unquantized is not None
    try:
        text, on_text = quality.eval_rows(bundle.unquantized, eval_text, seed)
    except quality.NotACausalLm:
        return {}
    float_bundle = bundle.unquantized
    float_model = float_bundle.decoder.uncached if float_bundle.decoder else float_bundle.module
    with float64_weights(float_model):
        oracle = quality.logits_runner(float_bundle)(text.rows)
    eager = quality.logits_runner(bundle)(text.rows)
    float_logits = [logits.to(torch.float32) for logits in oracle]
    return {
        "source": text.source,
        "on_text": on_text,
        "rows": list(text.rows),
        "float": float_logits,
        "eager": measured(float_logits, eager, text.rows),
    }


def run(
    load: Callable[[], Loaded], text: dict[str, Any], slots: int | None, longest: int
) -> list[torch.Tensor]:
    """The artifact's logits [n, vocab] on each row: with a KV cache of `slots` slots, a session
    per row on one instance (a prefill of half the row, at most `longest` tokens, then a step
    per token); without one, a call per row."""
    instance = load()
    found = []
    for row in text["rows"]:
        tokens = row.unsqueeze(0)
        try:
            if slots is None:
                found.append(_logits(instance.run((tokens,)))[0])
                continue
            cache = Cache(instance, slots)
            prefill = max(1, min(tokens.shape[-1] // 2, longest))
            steps = [_logits(cache.call(tokens[:, :prefill], 0))[0]]
            for position in range(prefill, tokens.shape[-1]):
                steps.append(_logits(cache.call(tokens[:, position : position + 1], position))[0])
            found.append(torch.cat(steps))
        except Exception as error:
            raise ArtifactFailed(
                f"the artifact failed on the quality text: {type(error).__name__}: {error}"
            ) from error
    return found


def measured(
    float_logits: Sequence[torch.Tensor],
    logits: Sequence[torch.Tensor],
    rows: Sequence[torch.Tensor],
) -> dict[str, Any]:
    """The next-token figures of `logits` against the float model's over every position of the
    rows, and both models' perplexity of them (over every row's next tokens together)."""
    found = NextToken.of(
        PerPosition.concat([per_position(f, q) for f, q in zip(float_logits, logits, strict=True)])
    )
    perplexity_float = _mean_perplexity(float_logits, rows)
    perplexity = _mean_perplexity(logits, rows)
    return found.to_json() | {
        "perplexity_float": perplexity_float,
        "perplexity": perplexity,
        "perplexity_ratio": perplexity / perplexity_float,
    }


def _mean_perplexity(logits: Sequence[torch.Tensor], rows: Sequence[torch.Tensor]) -> float:
    """exp of the mean negative log-likelihood over every row's next tokens."""
    total = sum(
        math.log(quality.perplexity(row_logits, row)) * (row.numel() - 1)
        for row_logits, row in zip(logits, rows, strict=True)
    )
    return math.exp(total / sum(row.numel() - 1 for row in rows))


def _logits(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """A causal LM's logits [1, n, vocab] among its outputs (its first), widened."""
    return pytree.tree_leaves(outputs)[0].detach().to(torch.float64)
