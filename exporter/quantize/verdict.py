"""The quality verdict: what quantization costs, judged apart from fidelity.

The artifact's own next-token logits at every judged live shape (or KV-cache step), what the
user ships, against the float model's float64 logits on the same inputs, which the goldens keep;
beside them the quantized model's in eager at the model's dtype (the goldens measured it) and
the greedy tokens of the float model and the artifact side by side; and the artifact on the
quality text (exporter/validate/text.py): its perplexity, KL divergence and top-1 there.
`quantize.budget` bounds the mean KL divergence and the top-1 agreement on that text (on the
validation inputs for a model that is not a causal LM, the KL divergence only); the job fails on
either (exit 1), saying it is quality, not fidelity, that failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from exporter.config import QualityBudget
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
    """The quality section of a job: the artifact's figures on the validation inputs (overall
    and per case), the quantized model's in eager there, the artifact's and eager's on the
    quality text (`text`: exporter/validate/text.py; None for a model that is not a causal LM),
    the greedy tokens where generated, and the budget, which the text's figures are judged by
    where there are some (top-1 only where they are text: QualityBudget)."""

    budget: QualityBudget
    artifact: NextToken | None
    artifact_per_case: dict[str, NextToken]
    eager: NextToken | None
    text: dict[str, Any] | None
    greedy: dict[str, Any] | None

    @property
    def under_budget(self) -> tuple[str, dict[str, float]] | None:
        """What the budget judges: where it was measured, and the figures."""
        if self.text is not None:
            return self.text["source"], self.text["artifact"]
        if self.artifact is not None:
            return "the validation inputs", self.artifact.to_json()
        return None

    @property
    def failures(self) -> list[str]:
        """Each budget the artifact's figures exceed, as a sentence."""
        judged = self.under_budget
        if judged is None:
            return []
        where, found = judged
        failures = []
        if not found["kld_mean"] <= self.budget.max_kld:
            failures.append(
                f"mean KL divergence {found['kld_mean']:.3g} nats on {where} is above "
                f"quantize.budget.max_kld={self.budget.max_kld:g}"
            )
        on_text = self.text is not None and self.text["on_text"]
        if on_text and not found["top1"] >= self.budget.min_top1:
            failures.append(
                f"top-1 agreement {found['top1']:.3g} on {where} is below "
                f"quantize.budget.min_top1={self.budget.min_top1:g}"
            )
        return failures

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """The figures in a line: `quality on the validation inputs (the artifact's own logits vs
        the float model's, 70 positions): KLD mean 0.0123 (p99 0.05, max 0.08), top-1 0.963, p
        drop 0.0041; quantized model in eager: KLD mean 0.0121`."""
        found = self.artifact
        if found is None:
            return "quality: not measured (the model has no next-token logits)"
        line = (
            f"quality on the validation inputs (the artifact's own logits vs the float model's, "
            f"{found.positions} positions): KLD mean {found.kld_mean:.3g} (p99 "
            f"{found.kld_p99:.3g}, max {found.kld_max:.3g}), top-1 {found.top1:.3g}, p drop "
            f"{found.prob_drop:.3g}"
        )
        if self.eager is not None:
            line += f"; quantized model in eager: KLD mean {self.eager.kld_mean:.3g}"
        return line

    def verdict(self) -> str:
        if self.passed:
            top1 = f" and quantize.budget.min_top1={self.budget.min_top1:g}"
            if self.text is None or not self.text["on_text"]:
                top1 = " (top-1 is judged on text only)"
            return f"quality passed: within quantize.budget.max_kld={self.budget.max_kld:g}{top1}"
        return "quality (what quantization costs) fails: " + "; ".join(self.failures) + "."

    def lines(self) -> list[str]:
        lines = [self.summary()]
        if self.text is not None:
            found, eager = self.text["artifact"], self.text["eager"]
            lines.append(
                f"on {found['positions']} positions of {self.text['source']}, the artifact "
                f"against the float model: KLD mean {found['kld_mean']:.3g} (p99 "
                f"{found['kld_p99']:.3g}), top-1 {found['top1']:.3g}, perplexity "
                f"{found['perplexity_float']:.4g} -> {found['perplexity']:.4g} (ratio "
                f"{found['perplexity_ratio']:.4g}); the quantized model in eager: KLD mean "
                f"{eager['kld_mean']:.3g}, top-1 {eager['top1']:.3g}"
            )
            beside = self.text.get("llama_cpp")
            if beside is not None:
                lines.append(
                    f"llama.cpp on the same file and rows: KLD mean {beside['kld_mean']:.3g} "
                    f"(p99 {beside['kld_p99']:.3g}), top-1 {beside['top1']:.3g}, perplexity "
                    f"ratio {beside['perplexity_ratio']:.4g}"
                )
        lines.append(self.verdict())
        if self.greedy is not None:
            lines.append(self.greedy["line"])
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "failures": self.failures,
            "budget": dataclasses.asdict(self.budget),
            "measured_on": "the artifact's own outputs against the float model's float64 logits",
            "artifact": self.artifact and self.artifact.to_json(),
            "eager": self.eager and self.eager.to_json(),
            "per_case": {key: found.to_json() for key, found in self.artifact_per_case.items()},
            **({"text": self.text} if self.text else {}),
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
    budget: QualityBudget,
    measuring: Measuring,
    goldens_quality: Mapping[str, Any],
    goldens_text: Mapping[str, Any],
    on_text: Mapping[str, Any] | None,
    llama_cpp: Mapping[str, Any] | None,
    generation: Generation | None,
    tokenizer_json: str | None,
) -> Quality:
    """The quality section: the artifact's figures that `measuring` collected during validation
    and `on_text`, its figures on the quality text (`llama_cpp`: llama.cpp's on the same rows),
    with what the goldens measured (eager's figures on both, the float model's greedy tokens,
    set beside the artifact's of `generation`)."""
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
    text = None
    if on_text is not None:
        text = {
            "source": goldens_text["source"],
            "on_text": goldens_text["on_text"],
            "artifact": dict(on_text),
            "eager": dict(goldens_text["eager"]),
            **({"llama_cpp": dict(llama_cpp)} if llama_cpp is not None else {}),
        }
    return Quality(
        budget,
        measuring.overall(),
        measuring.per_case(),
        NextToken(**eager) if eager else None,
        text,
        greedy,
    )
