"""The quality verdict: what quantization costs, judged apart from fidelity.

The artifact's own next-token logits at every judged live shape (or KV-cache step), what the
user ships, against the float model's float64 logits on the same inputs, which the goldens keep;
beside them the quantized model's in eager at the model's dtype (the goldens measured it), the
perplexity of float and quantized on a text, and the greedy tokens of the float model and the
artifact side by side. `quantize.max_kld` bounds the mean KL divergence over every judged
position and `quantize.min_top1` the top-1 agreement; the job fails on either (exit 1), saying
it is quality, not fidelity, that failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from exporter.quantize.quality import NextToken, PerPosition, per_position
from runtimes.verdict.report import Generation


class Measuring:
    """Collects the quality of one model's outputs case by case (a live shape's or a KV-cache
    step's label) against the float model's logits for the same case; the first outputs of a
    case count (a shape run again on a new instance computes the same)."""

    def __init__(self, float_logits: Mapping[str, torch.Tensor], logits_index: int) -> None:
        self.float_logits = float_logits
        self.logits_index = logits_index
        self.measured: dict[str, PerPosition] = {}

    def add(self, key: str, outputs: Sequence[torch.Tensor]) -> None:
        if key in self.measured or key not in self.float_logits:
            return
        logits = outputs[self.logits_index].detach().cpu()
        self.measured[key] = per_position(self.float_logits[key], logits)

    def per_case(self) -> dict[str, NextToken]:
        return {key: NextToken.of(measured) for key, measured in self.measured.items()}

    def overall(self) -> NextToken | None:
        if not self.measured:
            return None
        return NextToken.of(PerPosition.concat(list(self.measured.values())))

    def to_json(self) -> dict[str, Any]:
        """The figures as the goldens keep them (plain data)."""
        overall = self.overall()
        return {
            "overall": overall and overall.to_json(),
            "per_case": {key: found.to_json() for key, found in self.per_case().items()},
        }


@dataclass(frozen=True)
class Quality:
    """The quality section of a job: the artifact's figures (overall and per case), the quantized
    model's in eager, the perplexity and greedy tokens where measured, and the budget."""

    max_kld: float
    min_top1: float
    artifact: NextToken | None
    artifact_per_case: dict[str, NextToken]
    eager: NextToken | None
    perplexity: dict[str, Any] | None
    greedy: dict[str, Any] | None

    @property
    def failures(self) -> list[str]:
        """Each budget the artifact's figures exceed, as a sentence."""
        found = self.artifact
        if found is None:
            return []
        failures = []
        if not found.kld_mean <= self.max_kld:
            failures.append(
                f"mean KL divergence {found.kld_mean:.3g} nats is above quantize.max_kld="
                f"{self.max_kld:g}"
            )
        if not found.top1 >= self.min_top1:
            failures.append(
                f"top-1 agreement {found.top1:.3g} is below quantize.min_top1={self.min_top1:g}"
            )
        return failures

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """The figures in a line: `quality (the artifact's own logits vs the float model's, 70
        positions): KLD mean 0.0123 (p99 0.05, max 0.08), top-1 0.963, p drop 0.0041; quantized
        model in eager: KLD mean 0.0121; perplexity ratio 1.02`."""
        found = self.artifact
        if found is None:
            return "quality: not measured (the model has no next-token logits)"
        line = (
            f"quality (the artifact's own logits vs the float model's, {found.positions} "
            f"positions): KLD mean {found.kld_mean:.3g} (p99 {found.kld_p99:.3g}, max "
            f"{found.kld_max:.3g}), top-1 {found.top1:.3g}, p drop {found.prob_drop:.3g}"
        )
        if self.eager is not None:
            line += f"; quantized model in eager: KLD mean {self.eager.kld_mean:.3g}"
        if self.perplexity is not None:
            line += f"; perplexity ratio {self.perplexity['ratio']:.4g}"
        return line

    def verdict(self) -> str:
        if self.passed:
            return (
                f"quality passed: within quantize.max_kld={self.max_kld:g} and "
                f"quantize.min_top1={self.min_top1:g}"
            )
        return "quality (what quantization costs) fails: " + "; ".join(self.failures) + "."

    def lines(self) -> list[str]:
        lines = [self.summary(), self.verdict()]
        if self.perplexity is not None:
            found = self.perplexity
            lines.append(
                f"perplexity on {found['tokens']} tokens of {found['text']}: float "
                f"{found['float']:.4g}, quantized {found['quantized']:.4g} (eager at the model's "
                f"dtype), ratio {found['ratio']:.4g}"
            )
            on_text = found["next_token"]
            lines.append(
                f"on that text, the quantized model in eager against the float model: KLD mean "
                f"{on_text['kld_mean']:.3g} (p99 {on_text['kld_p99']:.3g}), top-1 "
                f"{on_text['top1']:.3g}, p drop {on_text['prob_drop']:.3g}"
            )
        if self.greedy is not None:
            lines.append(self.greedy["line"])
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "failures": self.failures,
            "max_kld": self.max_kld,
            "min_top1": self.min_top1,
            "measured_on": "the artifact's own outputs against the float model's float64 logits",
            "artifact": self.artifact and self.artifact.to_json(),
            "eager": self.eager and self.eager.to_json(),
            "per_case": {key: found.to_json() for key, found in self.artifact_per_case.items()},
            **({"perplexity": self.perplexity} if self.perplexity else {}),
            **({"greedy": self.greedy} if self.greedy else {}),
        }


def greedy_side_by_side(
    float_tokens: Sequence[int], artifact_tokens: Sequence[int], texts: Mapping[str, str] | None
) -> dict[str, Any]:
    """The float model's greedy tokens and the artifact's from one prompt, and where they part."""
    parts_at = next(
        (i for i, (a, b) in enumerate(zip(float_tokens, artifact_tokens, strict=False)) if a != b),
        None,
    )
    count = len(float_tokens)
    said = "all agree" if parts_at is None else f"first differs at token {parts_at}"
    side = {
        "float": list(float_tokens),
        "artifact": list(artifact_tokens),
        "parts_at": parts_at,
        "line": f"greedy {count} tokens, float model vs quantized artifact: {said}",
    }
    if texts:
        side["text"] = dict(texts)
    return side


def judged(
    max_kld: float,
    min_top1: float,
    measuring: Measuring,
    goldens_quality: Mapping[str, Any],
    generation: Generation | None,
    tokenizer_json: str | None,
) -> Quality:
    """The quality section: the artifact's figures that `measuring` collected during validation,
    with what the goldens measured (eager's figures, the perplexity, the float model's greedy
    tokens, set beside the artifact's of `generation`)."""
    eager = (goldens_quality.get("eager") or {}).get("overall")
    greedy = None
    float_tokens = goldens_quality.get("greedy_float")
    if generation is not None and float_tokens is not None:
        texts = None
        if tokenizer_json is not None:
            tokenizer = Tokenizer.from_str(tokenizer_json)
            texts = {
                who: tokenizer.decode(tokens, skip_special_tokens=False)
                for who, tokens in (("float", float_tokens), ("artifact", generation.artifact))
            }
        greedy = greedy_side_by_side(float_tokens, generation.artifact, texts)
    return Quality(
        max_kld,
        min_top1,
        measuring.overall(),
        measuring.per_case(),
        NextToken(**eager) if eager else None,
        goldens_quality.get("perplexity"),
        greedy,
    )
