"""The validate and benchmark groups' schemas (`validate`, `benchmark=`): how the artifact is
judged against the float64 oracle, and how it is timed beside eager."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from omegaconf import MISSING

from exporter.config.model import ModelDtype
from exporter.errors import ConfigError


class ValidationRule(Enum):
    """How an output is judged against the float64 oracle.

    `reference`: its error is within `factor` times the error of eager PyTorch at the model's
    dtype on the same inputs (what the model's own precision costs), plus `floor`;
    `absolute`: every element within atol or rtol (Polygraphy's rule), whatever the model."""

    reference = "reference"
    absolute = "absolute"


class HalfRule(Enum):
    """The reference rule's verdict on next-token logits at float16 or bfloat16.

    `strict`: the values alone, as at float32; `distribution`: values that fail it pass where
    the predictions are eager's own: top-1 agreement with the float64 oracle at least eager's
    less `top1_slack`, and mean KL divergence from it at most `kl_factor` times eager's."""

    strict = "strict"
    distribution = "distribution"


class LocalizeMode(Enum):
    """When the job searches for the first op of the exported program that diverges
    (exporter/localize/): `auto` when validation fails, `always` on a passing job too (at its
    worst shape, where nothing diverges beyond the rule: it then costs one lowering, and says
    so), `off` never. The search lowers parts of the program again: a few lowerings' time."""

    auto = "auto"
    always = "always"
    off = "off"


class RepairMode(Enum):
    """What a failed job does when its first diverging node is an op the backend's delegate
    computes otherwise while the node's inputs agree (exporter/localize/repair.py): `off` names the
    override that keeps the op out of the delegate, `auto` also lowers again with it, validates
    that artifact and ends with its verdict."""

    off = "off"
    auto = "auto"


# The reference rule's factor per model dtype when `validate.factor` is not set: above what a
# correct artifact reaches, below what a mistake does (docs/validation.md, "Pass rule", has the
# measurements). In float32 the error is a few ulps; an artifact that sums in another order than
# eager (a delegate's blocking) reaches a few times eager's, a real mistake hundreds to
# thousands of times it. The floor (validate.floor, relative to the output's scale) passes
# float32 errors too small to matter that a factor alone would fail, such as another
# approximation of an activation scaled up by a model's logit soft-capping.
# In bfloat16 and float16 the error is the rounding of every stored value, which a correct
# artifact shares with eager, so its error stays near eager's; a 1% error in the weights of one
# layer, about two bfloat16 roundings, about doubles it: a factor below 2 catches it.
DEFAULT_FACTORS = {
    ModelDtype.float32: 5.0,
    ModelDtype.bfloat16: 1.5,
    ModelDtype.float16: 1.5,
}


@dataclass
class ValidateConfig:
    """`atol`/`rtol` are the absolute rule's (default: the backend's); `factor` and `floor` the
    reference rule's: an output passes when its RMS error and its max abs error are each at
    most `factor` times eager's plus `floor` times the float64 output's RMS (for the RMS error)
    or its largest magnitude (for the max abs error).

    `localize_seconds` bounds the search for the first diverging node (null: no limit). It
    stops before a lowering that would take it past this many seconds and says what it
    narrowed down to. The default, ten minutes, leaves a small model's search room for all its
    cuts, while a large model's, whose one lowering of the whole program takes minutes, gets
    its short cuts, one whole lowering and a last cut: minutes, not hours."""

    rule: ValidationRule = ValidationRule.reference
    factor: float | None = None
    floor: float = 1.0e-5
    atol: float | None = None
    rtol: float | None = None
    extra_shapes: list[int] = field(default_factory=list)
    random_shapes: int = 2
    seed: int = 0
    localize: LocalizeMode = LocalizeMode.auto
    repair: RepairMode = RepairMode.off
    localize_seconds: float | None = 600.0
    half: HalfRule = HalfRule.distribution
    # Room for a correct half-precision artifact, whose attention may round to float16 where
    # eager's does not, and not for a 1% error in a trained model's output projection
    # (docs/validation.md, "Half precision", has the measurements).
    kl_factor: float = 8.0
    top1_slack: float = 0.02
    # A KV-cache model's sessions: decode positions judged besides the first decode step and
    # the last cache slot (every step runs; these are compared), and the greedy tokens
    # generated from one prompt by the artifact, eager and the oracle.
    sampled_positions: int = 6
    greedy_tokens: int = 16
    # The greedy generation's prompt as text, a user's turn: encoded with the checkpoint's
    # tokenizer and its chat template, and every generation decoded back to text (null: the
    # first session's first tokens, no text).
    prompt: str | None = None

    def __post_init__(self) -> None:
        for name in ("floor", "random_shapes", "sampled_positions", "greedy_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"validate.{name} is {getattr(self, name)}; it must be 0 or more."
                )
        if self.localize_seconds is not None and self.localize_seconds <= 0:
            # 0 reads as "none at all", which is validate.localize=off, not "no limit".
            raise ConfigError(
                f"validate.localize_seconds is {self.localize_seconds:g}; it must be more "
                "than 0, or null for no limit (validate.localize=off skips the search)."
            )
        if self.kl_factor < 1:
            raise ConfigError(
                f"validate.kl_factor is {self.kl_factor}; it must be 1 or more (the "
                "artifact's mean KL divergence over eager's at the model's dtype)."
            )
        if not 0 <= self.top1_slack <= 1:
            raise ConfigError(
                f"validate.top1_slack is {self.top1_slack}; it must be between 0 and 1 "
                "(a fraction of the positions)."
            )


@dataclass
class BenchmarkConfig:
    """Latency at every live shape, after validation and apart from it: the artifact and eager
    PyTorch (the exported program at the model's dtype, on the same device) each run `warmup`
    times untimed, then are timed until `repeats` runs or `seconds` have passed, whichever comes
    first (at least one warm-up and one timed run). Both compute with `threads` CPU threads
    (null: every core the job may use). One by default, as torch.utils.benchmark's Timer: with
    more, a run's time depends on whether it finds a worker thread awake or waits for it, and
    medians move between runs far more than with one (docs/benchmark.md, "Threads").
    `together`: load both at once and let them take turns (a machine that slows down slows
    both), or time one, free it, then the other (memory for one of them); null: together where
    loading both keeps the job within the peak memory it reached before (in export, lowering)
    or where the smaller of the two takes under a tenth of that peak."""

    enabled: bool = MISSING
    warmup: int = 5
    repeats: int = 50
    seconds: float = 1.0
    threads: int | None = 1
    together: bool | None = None

    def __post_init__(self) -> None:
        for key, value, least in (("warmup", self.warmup, 0), ("repeats", self.repeats, 1)):
            if value < least:
                raise ConfigError(f"benchmark.{key} is {value}; it must be {least} or more.")
        if self.seconds <= 0:
            raise ConfigError(f"benchmark.seconds is {self.seconds}; it must be more than 0.")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(
                f"benchmark.threads is {self.threads}; it must be 1 or more, or null for every "
                "core the job may use."
            )
