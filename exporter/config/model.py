"""The model group's schemas (`model=`), with what says how the model is exported: its dtype,
its dynamic dims (`dynamic`) and the export group's (`export`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

from exporter.errors import ConfigError


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
    local Hugging Face checkpoint directory or GGUF file (then the shape fields are ignored;
    exporter/config/inputs.py checks it when the job is composed)."""

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


@dataclass
class HfConfig(CausalLmConfig):
    """Any local Hugging Face causal-LM checkpoint (a directory written by save_pretrained(), or
    a GGUF file), loaded by transformers' own classes at `dtype`; never the network, never
    remote code. exporter/config/inputs.py checks the checkpoint when the job is composed."""

    checkpoint: str = MISSING


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


class ExportFailurePolicy(Enum):
    fail = "fail"
    draft = "draft"


class GuardPolicy(Enum):
    """What export does with a guard on a dynamic size that it cannot prove for every size in
    the bounds (`export.guards`): `prove` fails the export, naming the guard and its line;
    `runtime` makes it an assert the program checks when it runs, which validation's live
    shapes (the bounds' corners among them) then exercise."""

    prove = "prove"
    runtime = "runtime"


@dataclass
class ExportConfig:
    """`on_failure=fail`: a failed torch.export ends the job (exit 3) with draft_export's
    diagnosis; `draft`: the job goes on with draft_export's program, tagged as a draft.
    `guards`: GuardPolicy."""

    on_failure: ExportFailurePolicy = ExportFailurePolicy.fail
    guards: GuardPolicy = GuardPolicy.prove
