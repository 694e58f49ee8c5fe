"""Typed schemas of a job, stored in Hydra's ConfigStore by the command
(exporter/command/schemas.py): a wrong key or type fails at compose.

The YAML files in `conf/` pick a schema from the `schema/<group>` entries and fill in its
values; `JobConfig.__post_init__` checks what types alone cannot (bounds, tolerances).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields, is_dataclass
from difflib import get_close_matches
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from exporter.config import aten_ops, hf_checkpoint
from exporter.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Anchors the run dirs and the embedded MLflow store at the project, whatever the cwd.
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)


class DimMode(Enum):
    """How torch.export sees a dynamic dim: `backed` by the example's size (a `Dim`, whose guards
    may specialize it, which the export stage turns into an error), or `unbacked`, with no size
    to guard on (a ShapeVar of torch's ShapesSpec API), so nothing can specialize it."""

    backed = "backed"
    unbacked = "unbacked"


@dataclass
class DimBounds:
    """Inclusive bounds of one named dynamic dim; every consumer derives its shapes from these."""

    min: int = 1
    max: int = MISSING
    mode: DimMode = DimMode.backed


class ModelDtype(Enum):
    """The dtype of a model's weights, activations and artifact (`model.dtype`)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class ModelConfig:
    name: str = MISSING
    seed: int = 0
    dtype: ModelDtype = ModelDtype.float32


class KvCache(Enum):
    """How a causal LM is exported (`model.kv_cache`): `none`, token ids -> logits over the whole
    sequence; `static`, the generation loop's program: token ids and their cache positions ->
    logits, with a key/value cache of `model.max_cache_len` slots held as the program's mutable
    buffers, so a prefill and every decode step call the same program."""

    none = "none"
    static = "static"


class LlmOps(Enum):
    """The ops a causal LM's static KV cache is written and read with, as its backend asks
    (`backend.llm_ops` where the backend has the key): `custom`, ExecuTorch's LLM ops
    (`llama::update_cache` writes each call's keys and values, `llama::custom_sdpa` attends over
    the filled slots); `plain`, transformers' own (index_copy_ writes, its attention over every
    slot with a mask)."""

    custom = "custom"
    plain = "plain"


@dataclass
class CausalLmConfig(ModelConfig):
    """What every causal LM takes: how it is exported. `max_cache_len` (null: the seq bound's
    max) is the cache's slots with `kv_cache=static`."""

    kv_cache: KvCache = KvCache.none
    max_cache_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_cache_len is not None and self.max_cache_len < 2:
            raise ConfigError(
                f"model.max_cache_len is {self.max_cache_len}; it must be at least 2 (a prefill "
                "and one decode step), or null for the seq bound's max."
            )
        if self.max_cache_len is not None and self.kv_cache is KvCache.none:
            raise ConfigError(
                f"model.max_cache_len={self.max_cache_len} sizes a KV cache, and model.kv_cache "
                "is none: set model.kv_cache=static, or leave max_cache_len null."
            )


@dataclass
class LlamaConfig(CausalLmConfig):
    """transformers' LlamaForCausalLM: seeded random weights of this shape, or `checkpoint`, a
    local Hugging Face checkpoint directory or GGUF file (then the shape fields are ignored)."""

    checkpoint: str | None = None
    hidden_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    intermediate_size: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    # The output projection shares the token embedding's weights (Llama 3.2 1B and 3B do).
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint is not None:
            _check_checkpoint(self.checkpoint)


@dataclass
class HfConfig(CausalLmConfig):
    """Any local Hugging Face causal-LM checkpoint (a directory written by save_pretrained(), or
    a GGUF file), loaded by transformers' own classes at `dtype`; never the network, never
    remote code."""

    checkpoint: str = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_checkpoint(self.checkpoint)


def _check_checkpoint(checkpoint: str) -> None:
    # Here rather than in the builder: a wrong path or config.json fails at compose, before
    # torch is loaded.
    if not Path(checkpoint).exists():
        raise ConfigError(f"model.checkpoint={checkpoint}: no such directory or file.")
    hf_checkpoint.check(Path(checkpoint))


@dataclass
class MlpConfig(ModelConfig):
    in_features: int = MISSING
    hidden_features: int = MISSING
    out_features: int = MISSING


@dataclass
class MoeConfig(ModelConfig):
    """Top-k routed experts: each expert gathers the tokens routed to it, a data-dependent count."""

    features: int = MISSING
    hidden_features: int = MISSING
    experts: int = MISSING
    top_k: int = MISSING


@dataclass
class MaskedConfig(ModelConfig):
    """Boolean-mask selection: a gate picks rows, only those go through the MLP."""

    features: int = MISSING
    hidden_features: int = MISSING


@dataclass
class EncoderConfig(ModelConfig):
    """A transformer encoder block (LayerNorm, single-head self-attention without a mask, an
    MLP, residuals) over x [batch, seq, features]: a model with two dynamic dims."""

    features: int = MISSING
    hidden_features: int = MISSING


class ToyKind(Enum):
    """The toy models of exporter/models/toys.py, each one op pattern; conf/model/<kind>.yaml."""

    rms_norm = "rms_norm"
    rms_norm_chain = "rms_norm_chain"
    rms_norm_residual = "rms_norm_residual"
    rms_norm_gated = "rms_norm_gated"
    linear = "linear"
    gqa_attention = "gqa_attention"
    embedding = "embedding"
    rotary = "rotary"


@dataclass
class ToyConfig(ModelConfig):
    """A toy model isolating one op pattern, picked by `kind`; each toy reads the shape fields
    it needs and ignores the others."""

    kind: ToyKind = MISSING
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 100
    out_features: int = 48
    eps: float = 1e-6
    max_positions: int = 128


@dataclass
class CustomModelConfig(ModelConfig):
    """Your own model: `factory` is "package.module:function" or "path/to/file.py:function",
    called with `options` and returning an exporter.models.ModelDeclaration."""

    factory: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)


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


class EmbeddingQuant(Enum):
    """How the token embedding's table is quantized (`quantize.embedding`): weight-only, per
    group of `quantize.group_size` for int4, per row for int8."""

    none = "none"
    int8 = "int8"
    int4 = "int4"


@dataclass
class BackendConfig:
    """What every backend has; each backend module subclasses it with its own defaults and
    settings (exporter/backends/). `atol`/`rtol` are the backend's default tolerances, which
    `validate.atol/rtol` override; `device` is where the artifact runs, one of the backend's
    `devices` (every backend has the key, so a sweep over backends can set it once)."""

    # The devices this backend's artifact runs on: PyTorch's (cpu, cuda), or a wgpu adapter
    # choice for backend=webgpu (auto, gpu, cpu).
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    # The model dtypes (`model.dtype`) its artifacts compute in.
    dtypes: ClassVar[tuple[ModelDtype, ...]] = tuple(ModelDtype)
    # The quantization schemes (`quantize=`) and embedding quantizations (`quantize.embedding`)
    # its artifacts compute right: float only unless the backend says, since a lowering can
    # take a quantized pattern without an error and compute garbage (docs/quantization.md).
    quant_schemes: ClassVar[tuple[QuantScheme, ...]] = (QuantScheme.none,)
    embedding_quants: ClassVar[tuple[EmbeddingQuant, ...]] = (EmbeddingQuant.none,)
    # Why it runs no other: what the refusal of another quotes.
    quant_refusal: ClassVar[str] = ""

    name: str = MISSING
    atol: float = MISSING
    rtol: float = MISSING
    device: str = "cpu"

    def quantize_recipes(self) -> tuple[str, ...]:
        """What `quantize=auto` chooses from per layer on this backend, smallest first
        (exporter/quantize/recipes.py names them); none: it plans nothing here."""
        return ()

    def __post_init__(self) -> None:
        if self.device not in self.devices:
            allowed = " or ".join(filter(None, [", ".join(self.devices[:-1]), self.devices[-1]]))
            raise ConfigError(
                f"backend.device={self.device}: backend={self.name} runs on {allowed} "
                "(allowed values of backend.device)."
            )


class FallbackPolicy(Enum):
    auto = "auto"
    strict = "strict"
    data_dependent = "data_dependent"


class WrongKernels(Enum):
    """Ops a backend's delegate is known to compute as another function than the op asks
    (exporter/backends/common/xnnpack_rewrites.py): `avoid` rewrites each into ops the delegate
    computes right, `allow` lets the delegate take them as its partitioner would."""

    avoid = "avoid"
    allow = "allow"


@dataclass
class FallbackConfig:
    """Where ops the backend cannot or must not run go: one vocabulary that each backend maps to
    its own controls.

    `auto`: the backend takes what it can, the rest runs on the portable CPU kernels (or in
    PyTorch); `strict`: everything on the backend, or the job fails at lowering;
    `data_dependent`: like auto, and every node whose output shape depends on tensor values
    (nonzero, boolean indexing, masked_select, unique...) stays off the backend.
    `ops` forces the named ATen ops ("aten.nonzero.default") off the backend; `min_block_size`
    is the fewest compute nodes a delegated block may have; `wrong_kernels` what becomes of ops
    the backend is known to compute wrongly."""

    policy: FallbackPolicy = MISSING
    ops: list[str] = field(default_factory=list)
    min_block_size: int = 1
    wrong_kernels: WrongKernels = WrongKernels.avoid

    def __post_init__(self) -> None:
        if self.min_block_size < 1:
            raise ConfigError(
                f"fallback.min_block_size is {self.min_block_size}; it must be 1 or more."
            )
        for op in self.ops:
            _check_op_name(op)
        if self.policy is FallbackPolicy.strict and self.ops:
            raise ConfigError(
                f"fallback=strict requires every op on the backend, but fallback.ops forces "
                f"{', '.join(self.ops)} off it; use fallback=auto with fallback.ops, or drop "
                "fallback.ops."
            )
        if self.policy is FallbackPolicy.strict and self.min_block_size > 1:
            raise ConfigError(
                f"fallback=strict requires every op on the backend, but "
                f"fallback.min_block_size={self.min_block_size} keeps smaller blocks off it; "
                "use fallback=auto with fallback.min_block_size, or set it to 1."
            )

    def partitioning(self) -> dict[str, Any]:
        """What changes the partition; `strict` and `auto` partition alike and differ in the
        verdict only, so a strict job can reuse an auto job's lowering."""
        return {
            "data_dependent_off": self.policy is FallbackPolicy.data_dependent,
            "ops": sorted(self.ops),
            "min_block_size": self.min_block_size,
            "wrong_kernels": self.wrong_kernels.value,
        }


def _check_op_name(op: str) -> None:
    """`fallback.ops` entries name an operator overload as the partition report prints it:
    namespace.name.overload. ATen names are checked against torch's declarations; other
    namespaces (ExecuTorch's dim_order_ops) exist only once their backend is imported, so only
    their form is checked."""
    namespace, _, name_and_overload = op.partition(".")
    aten = aten_ops.declared() if namespace == "aten" else None
    unknown = aten is not None and name_and_overload not in aten
    if op.count(".") != 2 or not all(op.split(".")) or unknown:
        raise ConfigError(
            f"fallback.ops has {op!r}, which is not an operator overload; write it as the "
            "partition report prints ops, namespace.name.overload (aten.nonzero.default)."
        )


class ExportFailurePolicy(Enum):
    fail = "fail"
    draft = "draft"


@dataclass
class ExportConfig:
    """`on_failure=fail`: a failed torch.export ends the job (exit 3) with draft_export's
    diagnosis; `draft`: the job goes on with draft_export's program, tagged as a draft."""

    on_failure: ExportFailurePolicy = ExportFailurePolicy.fail


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


# The reference rule's factor per model dtype when `validate.factor` is not set. In float32 the
# error is a few ulps, and an artifact that sums in another order (XNNPACK's blocking, against
# eager's) was measured at up to 3.7 times eager's (a tiny Gemma); any real mistake is hundreds
# to thousands of times it. The floor (validate.floor, relative to the output's scale) passes
# float32 errors too small to matter that a factor would not: XNNPACK's tanh, scaled by Gemma2's
# logit soft-capping, is 13 times eager's error at 4.5e-6 of the output's RMS.
# In bfloat16 and float16 the error is the rounding of every stored value, which artifacts
# share: correct ones measured 0.86 to 1.24 times eager's, and a 1% error in the weights of
# one layer, about two bfloat16 roundings, makes it about twice: a factor below 2 catches it.
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
    narrowed down to. 600 s: the default Llama's and llama_45m's searches lower about two
    programs' worth of cuts; SmolLM2-135M's whole program took 206 s to lower on 2 cores, so
    its search gets the short cuts, one whole lowering and a last cut, and a 1B model's search
    takes ten minutes, not hours."""

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

    def __post_init__(self) -> None:
        if self.localize_seconds is not None and self.localize_seconds <= 0:
            # 0 reads as "none at all", which is validate.localize=off, not "no limit".
            raise ConfigError(
                f"validate.localize_seconds is {self.localize_seconds:g}; it must be more "
                "than 0, or null for no limit (validate.localize=off skips the search)."
            )
        for name in ("sampled_positions", "greedy_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"validate.{name} is {getattr(self, name)}; it must be 0 or more."
                )

    half: HalfRule = HalfRule.distribution
    # Measured (docs/validation.md, "Half precision"): SmolLM2-135M's correct float16 XNNPACK
    # artifact reaches 3.9 times eager's mean KL divergence and flips 1 of 127 top tokens that
    # eager keeps; a 1% scaled output projection or last MLP of it reaches 15 to 23 times eager's.
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


@dataclass
class BenchmarkConfig:
    """Latency at every live shape, after validation and apart from it: the artifact and eager
    PyTorch (the exported program at the model's dtype, on the same device) each run `warmup`
    times untimed, then are timed until `repeats` runs or `seconds` have passed, whichever comes
    first (at least one warm-up and one timed run). Both compute with `threads` CPU threads
    (null: every core the job may use). One by default, as torch.utils.benchmark's Timer: on
    this 2-core machine the default Llama's 2-thread medians moved by up to 111% between two
    runs (some runs wait for a sleeping worker thread, some do not), 1-thread ones by 3%.
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
        if self.eval_text is not None and not Path(self.eval_text).is_file():
            raise ConfigError(
                f"quantize.eval_text={self.eval_text}: no such file (a UTF-8 text that quality "
                "is measured on)."
            )

    @property
    def enabled(self) -> bool:
        return self.scheme is not QuantScheme.none or self.embedding is not EmbeddingQuant.none


@dataclass
class MlflowConfig:
    """`artifact_location`: where a new experiment keeps its files; empty lets the store decide
    (a tracking server's --artifacts-destination)."""

    enabled: bool = MISSING
    tracking_uri: str = ""
    artifact_location: str = ""
    experiment: str = "exporter"

    def __post_init__(self) -> None:
        if self.enabled and not self.tracking_uri:
            raise ConfigError(
                "mlflow.tracking_uri is not set; give the store to log to, e.g. "
                "mlflow.tracking_uri=http://HOST:5000 for mlflow=server, or use mlflow=local "
                "(a SQLite file under outputs/) or mlflow=off."
            )


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    dynamic: dict[str, DimBounds] = field(default_factory=dict)
    export: ExportConfig = field(default_factory=ExportConfig)
    backend: BackendConfig = MISSING
    fallback: FallbackConfig = MISSING
    validate: ValidateConfig = MISSING
    quantize: QuantizeConfig = MISSING
    benchmark: BenchmarkConfig = MISSING
    mlflow: MlflowConfig = MISSING
    # A pre-built artifact to validate instead of exporting and lowering the model.
    artifact: str | None = None
    # Reuse exported programs, goldens and lowered artifacts across jobs (`cache=off`: rebuild).
    cache: bool = True
    # Write bundle/ into the run dir: the artifact, its goldens and plan, for a target's check
    # (`python -m runtimes.check`) without the model (`bundle=off`: none).
    bundle: bool = True
    cache_dir: str = "${project_root:}/outputs/cache"

    def __post_init__(self) -> None:
        if self.model.dtype not in self.backend.dtypes:
            allowed = ", ".join(dtype.value for dtype in self.backend.dtypes)
            raise ConfigError(
                f"model.dtype={self.model.dtype.value}: backend={self.backend.name} computes in "
                f"{allowed} only (allowed values of model.dtype with this backend)."
            )
        self._check_quantize()
        modes = {bounds.mode for bounds in self.dynamic.values() if bounds.min < bounds.max}
        if len(modes) > 1:
            # torch 2.14 has no spec for both: ShapesSpec makes every dim it names unbacked,
            # a Dim-style spec makes every dim backed.
            raise ConfigError(
                "dynamic: "
                + ", ".join(f"{name}.mode={b.mode.value}" for name, b in self.dynamic.items())
                + "; one export takes all its dims backed or all unbacked."
            )
        for name, bounds in self.dynamic.items():
            if bounds.min < 1:
                raise ConfigError(f"dynamic.{name}.min is {bounds.min}; it must be at least 1.")
            if bounds.min > bounds.max:
                raise ConfigError(
                    f"dynamic.{name}: min ({bounds.min}) is greater than max ({bounds.max}); "
                    f"set dynamic.{name}.min <= dynamic.{name}.max."
                )
        for size in self.validate.extra_shapes:
            for name, bounds in self.dynamic.items():
                if not bounds.min <= size <= bounds.max:
                    raise ConfigError(
                        f"validate.extra_shapes has {size}, outside dynamic.{name} bounds "
                        f"[{bounds.min}, {bounds.max}]; "
                        f"allowed sizes are {bounds.min}..{bounds.max}."
                    )
        if self.validate.random_shapes < 0:
            raise ConfigError(
                f"validate.random_shapes is {self.validate.random_shapes}; it must be 0 or more."
            )
        for name in ("atol", "rtol"):
            # validate's tolerance where set, else the backend's default: name the one in force.
            owner = "backend" if getattr(self.validate, name) is None else "validate"
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"{owner}.{name} is {value}; it must be 0 or more.")
        if (
            self.validate.prompt is not None
            and getattr(self.model, "kv_cache", None) is not KvCache.static
        ):
            raise ConfigError(
                "validate.prompt is the prompt of a KV-cache model's greedy generation; set "
                "model.kv_cache=static (a causal LM with a checkpoint's tokenizer: model=hf or "
                "model=llama with model.checkpoint)."
            )
        if self.factor < 1:
            raise ConfigError(
                f"validate.factor is {self.factor}; it must be 1 or more (the artifact's error "
                "over eager's at the model's dtype)."
            )
        if self.validate.floor < 0:
            raise ConfigError(f"validate.floor is {self.validate.floor}; it must be 0 or more.")
        if self.validate.kl_factor < 1:
            raise ConfigError(
                f"validate.kl_factor is {self.validate.kl_factor}; it must be 1 or more (the "
                "artifact's mean KL divergence over eager's at the model's dtype)."
            )
        if not 0 <= self.validate.top1_slack <= 1:
            raise ConfigError(
                f"validate.top1_slack is {self.validate.top1_slack}; it must be between 0 and 1 "
                "(a fraction of the positions)."
            )
        if self.artifact is not None and not Path(self.artifact).is_file():
            raise ConfigError(f"artifact={self.artifact}: no such file.")
        self._check_cache()

    def _check_quantize(self) -> None:
        """The quantization asked for must be one the backend computes right."""
        backend, quantize = self.backend, self.quantize
        for key, choice, allowed in (
            ("quantize", quantize.scheme, backend.quant_schemes),
            ("quantize.embedding", quantize.embedding, backend.embedding_quants),
        ):
            if choice not in allowed:
                names = ", ".join(option.value for option in allowed)
                raise ConfigError(
                    f"{key}={choice.value}: backend={backend.name} runs {key}={names} only "
                    f"(allowed values of {key} with this backend). {backend.quant_refusal}"
                )
        if quantize.llama_cpp:
            self._check_llama_cpp()
        if quantize.scheme is QuantScheme("auto"):
            if not backend.quantize_recipes():
                raise ConfigError(
                    f"quantize=auto: backend={backend.name} on {backend.device} has no "
                    "quantized layers to plan with; use backend=aoti or eager (cpu), or "
                    "executorch."
                )
            if quantize.embedding is not EmbeddingQuant.none:
                raise ConfigError(
                    "quantize.embedding: quantize=auto plans the token embedding with the rest "
                    "of the model; leave quantize.embedding=none."
                )

    def _check_llama_cpp(self) -> None:
        """quantize.llama_cpp runs the GGUF file a quantized model was read from, with
        llama-cpp-python."""
        checkpoint = getattr(self.model, "checkpoint", None)
        if not self.quantize.enabled or not checkpoint:
            raise ConfigError(
                "quantize.llama_cpp: llama.cpp runs the GGUF checkpoint a quantized model was "
                "read from; set model.checkpoint=FILE.gguf and a quantize scheme."
            )
        if hf_checkpoint.gguf_file(Path(checkpoint)) is None:
            raise ConfigError(
                f"quantize.llama_cpp: model.checkpoint={checkpoint} is no GGUF file, which "
                "llama.cpp runs."
            )
        if importlib.util.find_spec("llama_cpp") is None:
            raise ConfigError(
                "quantize.llama_cpp: llama.cpp's Python binding is not installed: pip install "
                "llama-cpp-python (it builds llama.cpp for this machine)."
            )

    def _check_cache(self) -> None:
        """A prefill must fit the cache: the seq bound at most `model.max_cache_len`."""
        model = self.model
        if not isinstance(model, CausalLmConfig) or model.max_cache_len is None:
            return
        seq = self.dynamic.get("seq")
        if seq is not None and seq.max > model.max_cache_len:
            raise ConfigError(
                f"dynamic.seq.max is {seq.max}, beyond model.max_cache_len ({model.max_cache_len})"
                ": a prefill must fit the cache. Lower dynamic.seq.max, raise "
                "model.max_cache_len, or leave it null (the seq bound's max)."
            )

    @property
    def atol(self) -> float:
        return self.backend.atol if self.validate.atol is None else self.validate.atol

    @property
    def rtol(self) -> float:
        return self.backend.rtol if self.validate.rtol is None else self.validate.rtol

    @property
    def factor(self) -> float:
        if self.validate.factor is None:
            return DEFAULT_FACTORS[self.model.dtype]
        return self.validate.factor


# How alike (difflib's ratio) a key must be to a declared one to be named as the key meant: a
# letter or two off in a word of four or more passes (`validat.atol`: 0.96, `atl` for `atol`:
# 0.86); `foo` for `floor` (0.75) does not.
_NEAR = 0.8
# A last part that many keys share (`seed`, `min`) names a few of them, not every one.
_MOST_SUGGESTED = 3

# What a key that a config group leaves for the user to set takes.
_MISSING_VALUES = {
    "model.checkpoint": (
        "DIR, a Hugging Face checkpoint directory written by save_pretrained(), or FILE.gguf"
    ),
}


def to_job(cfg: DictConfig) -> JobConfig:
    """The composed config as typed objects; raises ConfigError for keys and values the schema
    rejects."""
    _check_keys(cfg)
    try:
        job: Any = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as error:
        key = error.full_key
        raise ConfigError(
            f"{key} is not set; give it on the command line: "
            f"{key}={_MISSING_VALUES.get(key, 'VALUE')}."
        ) from None
    except OmegaConfBaseException as error:
        raise ConfigError(str(error)) from error
    return job


def _check_keys(cfg: DictConfig) -> None:
    """Raises ConfigError naming every key no schema declares, with the nearest valid key.

    Hydra lets `+key=value` add a key anywhere, and converting to the typed schema drops what
    it does not know: a typo such as `+validat.atol=1` would be ignored without a word."""
    known: list[str] = []
    unknown: list[str] = []

    def walk(node: DictConfig, prefix: str, inside_unknown: bool) -> None:
        schema = OmegaConf.get_type(node)
        declared = {f.name for f in fields(schema)} if is_dataclass(schema) else None
        for key, value in node.items_ex(resolve=False):
            path = f"{prefix}{key}"
            stray = inside_unknown or (declared is not None and key not in declared)
            if isinstance(value, DictConfig) and len(value):
                walk(value, f"{path}.", stray)
            else:
                (unknown if stray else known).append(path)

    walk(cfg, "", inside_unknown=False)
    if unknown:
        named = "; ".join(f"+{key}{_nearest(key, known)}" for key in unknown)
        raise ConfigError(
            f"unknown key {named}. The job's schema has no such key; `python -m exporter "
            "--cfg job` prints every key it has."
        )


def _nearest(key: str, known: list[str]) -> str:
    """` (nearest valid key: K)` for a key that looks like a misspelling of K: the whole dotted
    key near one declared, or else its last part near the last part of declared ones (`+atol=1`
    names backend.atol and validate.atol); nothing for a key near none."""
    close = get_close_matches(key, known, n=1, cutoff=_NEAR)
    if not close:
        leaves = {k: k.rpartition(".")[2] for k in known}
        near_leaves = get_close_matches(
            key.rpartition(".")[2], set(leaves.values()), n=1, cutoff=_NEAR
        )
        close = sorted(k for k, leaf in leaves.items() if leaf in near_leaves)[:_MOST_SUGGESTED]
    if not close:
        return ""
    return f" (nearest valid key{'s' if len(close) > 1 else ''}: {', '.join(close)})"


def mlflow_of(cfg: DictConfig) -> MlflowConfig:
    """The job's MLflow settings alone, typed: usable when a value elsewhere is wrong."""
    try:
        mlflow: Any = OmegaConf.to_object(cfg.mlflow)
    except OmegaConfBaseException as error:
        raise ConfigError(str(error)) from error
    return mlflow


def flatten(cfg: DictConfig) -> dict[str, str]:
    """`{"model.hidden_size": "64", ...}`: the resolved config as MLflow params."""
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix.rstrip(".")] = str(node)

    try:
        container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except OmegaConfBaseException:
        # A config rejected for a value that does not resolve still gets its params, as written.
        container = OmegaConf.to_container(cfg, enum_to_str=True)
    walk(container, "")
    return flat
