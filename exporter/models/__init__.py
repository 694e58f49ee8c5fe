"""The model stage: a model config and the dynamic bounds -> a ModelBundle."""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Mapping

import torch

from exporter.config import (
    CausalLmConfig,
    CustomModelConfig,
    DimBounds,
    EncoderConfig,
    HfConfig,
    KvCache,
    LlamaConfig,
    LlmOps,
    MaskedConfig,
    MlpConfig,
    ModelConfig,
    MoeConfig,
    ToyConfig,
)
from exporter.errors import ConfigError
from exporter.models.bundle import (
    Decoder,
    DynamicDim,
    ModelBundle,
    ModelDeclaration,
    RunnerMetadata,
    torch_dtype,
    weight_bytes,
    weights,
)

log = logging.getLogger(__name__)

# Each schema's builder: the module of this package whose declare() builds it. Imported when its
# model is built, so a job imports only its own model's libraries (transformers for llama), and
# a model's cache key sees its own module, not every model's.
_BUILDERS: dict[type[ModelConfig], str] = {
    LlamaConfig: "llama",
    HfConfig: "hf",
    MlpConfig: "mlp",
    MoeConfig: "moe",
    MaskedConfig: "masked",
    EncoderConfig: "encoder",
    CustomModelConfig: "custom",
    ToyConfig: "toys",
}

__all__ = [
    "Decoder",
    "DynamicDim",
    "ModelBundle",
    "ModelDeclaration",
    "RunnerMetadata",
    "build",
    "builder",
    "torch_dtype",
    "weight_bytes",
    "weights",
]


def builder(cfg: ModelConfig) -> str:
    """The module that builds the model of `cfg` (its `declare`)."""
    return f"{__name__}.{_BUILDERS[type(cfg)]}"


def build(
    cfg: ModelConfig, dynamic: Mapping[str, DimBounds], llm_ops: LlmOps = LlmOps.plain
) -> ModelBundle:
    """The model of `cfg` within the `dynamic` bounds; a static KV cache written and read with
    `llm_ops` (the backend's choice) where they fit the model."""
    # Seeded here for every builder, the user's factory too: weights drawn at random are the
    # same in every process, as the cache and the goldens need.
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        declaration = importlib.import_module(builder(cfg)).declare(_with_cache_slots(cfg, dynamic))
    if llm_ops is LlmOps.custom and declaration.decoder is not None:
        declaration = _with_llm_ops(declaration)
    dtype = torch_dtype(cfg.dtype)
    make_inputs = declaration.make_inputs

    def make_inputs_at_dtype(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(dtype) if t.is_floating_point() else t for t in make_inputs(sizes, seed))

    return ModelBundle(
        name=cfg.name,
        # A builder may make its module at the dtype already (a large model should); this casts
        # the others, and every builder's floating inputs.
        module=declaration.module.to(dtype),
        input_names=declaration.input_names,
        output_names=declaration.output_names,
        dims=_bound_dims(cfg.name, declaration, dynamic),
        make_inputs=make_inputs_at_dtype,
        logits_outputs=declaration.logits_outputs,
        decoder=declaration.decoder,
        export_strict=declaration.export_strict,
        file_quantization=declaration.file_quantization,
        preprocessor=declaration.preprocessor,
    )


def _with_llm_ops(declaration: ModelDeclaration) -> ModelDeclaration:
    # Imported by name: a model with a decoder was built by a builder that imports causal_lm
    # (so its cache key holds it already), and an import statement here would put causal_lm,
    # and transformers, into every model's key.
    causal_lm = importlib.import_module(f"{__name__}.causal_lm")
    declaration, misfit = causal_lm.with_llm_ops(declaration)
    if misfit:
        log.warning(
            "[model] backend.llm_ops=custom: ExecuTorch's LLM ops do not fit %s: %s; its KV "
            "cache keeps transformers' ops (index_copy_ writes, its attention with a mask)",
            type(declaration.module.model).__name__,
            misfit,
        )
    elif declaration.decoder and declaration.decoder.llm_ops:
        log.info(
            "[model] the KV cache is written by llama::update_cache and read by "
            "llama::custom_sdpa (backend.llm_ops=custom): a target imports "
            "executorch.extension.llm.custom_ops.custom_ops before loading the program"
        )
    return declaration


def _with_cache_slots(cfg: ModelConfig, dynamic: Mapping[str, DimBounds]) -> ModelConfig:
    """A causal LM with `model.kv_cache=static` and no `model.max_cache_len` gets the seq bound's
    max as its cache's slots: the longest prefill fills the cache."""
    if not isinstance(cfg, CausalLmConfig) or cfg.kv_cache is KvCache.none:
        return cfg
    if cfg.max_cache_len is not None or "seq" not in dynamic:
        return cfg
    return dataclasses.replace(cfg, max_cache_len=dynamic["seq"].max)


def _bound_dims(
    model: str, declaration: ModelDeclaration, dynamic: Mapping[str, DimBounds]
) -> tuple[DynamicDim, ...]:
    declared = sorted(declaration.dim_axes)
    for name in dynamic:
        if name not in declaration.dim_axes:
            raise ConfigError(
                f"dynamic.{name}: model '{model}' has no dynamic dim '{name}'; "
                f"its dims are: {', '.join(declared)}."
            )
    dims = []
    for name in declared:
        if name not in dynamic:
            raise ConfigError(
                f"dynamic.{name} is not set; model '{model}' needs bounds for its dims "
                f"({', '.join(declared)}): choose dynamic={model} or a file in conf/dynamic/ "
                "that bounds them."
            )
        bounds = dynamic[name]
        limit = declaration.dim_limits.get(name)
        if limit is not None and bounds.max > limit:
            raise ConfigError(
                f"dynamic.{name}.max is {bounds.max}, beyond what model '{model}' supports "
                f"({limit}); allowed: {bounds.min}..{limit}."
            )
        axes = tuple(declaration.dim_axes[name])
        dims.append(DynamicDim(name, axes, bounds.min, bounds.max, bounds.mode))
    return tuple(dims)
