"""The quantize group's schemas (`quantize=`): how the model is quantized before export, and
what that may cost."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from exporter.errors import ConfigError

# How the model's linear layers are quantized (`quantize=<scheme>`), with torchao's
# configurations, the ones ExecuTorch's own LLM export uses, under the names users know them by
# (ExecuTorch's `--qlinear`), which are no Python identifiers: `QuantScheme("8da4w")`.
#   8da4w        int8 activations quantized per token as the layer runs, int4 weights per group
#   8da8w        int8 activations per token, int8 weights per output channel
#   int8_weight  weights only (activations stay floating), int8 per output channel
#   int4_weight  weights only, int4 per group
#   auto         a precision and recipe per layer, the fewest bytes within quantize.budget; a
#                GGUF checkpoint's own codes kept where the backend's kernels hold them
QuantScheme = Enum(
    "QuantScheme",
    [(name, name) for name in ("none", "8da4w", "8da8w", "int8_weight", "int4_weight", "auto")],
)


# The groups PyTorch's int4 kernels take (aten._weight_int4pack_mm and its CPU twin): what a
# backend that computes quantize=int4_weight with them takes as quantize.group_size.
INT4_KERNEL_GROUPS = (32, 64, 128, 256)


class EmbeddingQuant(Enum):
    """How the token embedding's table is quantized (`quantize.embedding`): weight-only, per
    group of `quantize.group_size` for int4, per row for int8."""

    none = "none"
    int8 = "int8"
    int4 = "int4"


@dataclass
class QualityBudget:
    """What quantization may cost against the float model: the mean next-token KL divergence at
    most `max_kld` nats and the top-1 agreement at least `min_top1`, over the positions of the
    text quality is measured on (a model with a tokenizer; `quantize.eval_text`). A model
    without one is measured on random token ids, where only `max_kld` is judged: a random-weight
    model's next-token distributions are nearly flat, and its top token flips on any change.

    The defaults come from measurements on a trained model (docs/quantization.md): they pass
    what llama.cpp's own run of a 4-bit GGUF file costs, with room, and fail a model that loses
    one next token in ten.
    """

    max_kld: float = 0.05
    min_top1: float = 0.9

    def __post_init__(self) -> None:
        if self.max_kld < 0:
            raise ConfigError(f"quantize.budget.max_kld is {self.max_kld}; it must be 0 or more.")
        if not 0 <= self.min_top1 <= 1:
            raise ConfigError(
                f"quantize.budget.min_top1 is {self.min_top1}; it must be between 0 and 1 (a "
                "fraction of the positions)."
            )


@dataclass
class QuantizeConfig:
    """Quantization of the model before export, and how much quality it may cost.

    The artifact is judged twice: for fidelity, against the quantized model (a float64 oracle of
    its own arithmetic, the reference rule against the quantized model in eager); for quality,
    the artifact's own next-token logits against the float model's, within `budget`, on text
    where the model has a tokenizer (Python's documentation, or the file `eval_text`).
    `scheme=auto` chooses a precision and recipe per layer, the fewest bytes within the budget
    (a GGUF checkpoint's own codes where the backend holds them). `attribution` measures the
    quality each layer costs; `skip` names the modules (fully qualified, as
    `model.named_modules()` gives them) left in float. `llama_cpp` runs a GGUF checkpoint with
    llama.cpp on the same text and reports its figures beside the artifact's (llama-cpp-python
    installed; runtimes/loaders/llama_cpp.py)."""

    scheme: QuantScheme = QuantScheme.none
    group_size: int = 32
    embedding: EmbeddingQuant = EmbeddingQuant.none
    budget: QualityBudget = field(default_factory=QualityBudget)
    eval_text: str | None = None
    llama_cpp: bool = False
    attribution: bool = False
    skip: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ConfigError(f"quantize.group_size is {self.group_size}; it must be 1 or more.")
        if self.scheme is QuantScheme("auto") and self.embedding is not EmbeddingQuant.none:
            raise ConfigError(
                "quantize.embedding: quantize=auto plans the token embedding with the rest "
                "of the model; leave quantize.embedding=none."
            )

    @property
    def enabled(self) -> bool:
        return self.scheme is not QuantScheme.none or self.embedding is not EmbeddingQuant.none
