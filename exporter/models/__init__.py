"""The model stage: a model config and the dynamic bounds -> a ModelBundle."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from exporter.config import (
    CustomModelConfig,
    DimBounds,
    EncoderConfig,
    LlamaConfig,
    MaskedConfig,
    MlpConfig,
    ModelConfig,
    MoeConfig,
    ToyConfig,
)
from exporter.errors import ConfigError
from exporter.models import custom, encoder, llama, masked, mlp, moe, toys
from exporter.models.bundle import DynamicDim, ModelBundle, ModelDeclaration

_BUILDERS: dict[type[ModelConfig], Callable[..., ModelDeclaration]] = {
    LlamaConfig: llama.declare,
    MlpConfig: mlp.declare,
    MoeConfig: moe.declare,
    MaskedConfig: masked.declare,
    EncoderConfig: encoder.declare,
    CustomModelConfig: custom.declare,
    ToyConfig: toys.declare,
}

__all__ = ["DynamicDim", "ModelBundle", "ModelDeclaration", "build", "source_files"]


def build(cfg: ModelConfig, dynamic: Mapping[str, DimBounds]) -> ModelBundle:
    # Seeded here for every builder, the user's factory too: weights drawn at random are the
    # same in every process, as the cache and the goldens need.
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        declaration = _BUILDERS[type(cfg)](cfg)
    return ModelBundle(
        name=cfg.name,
        module=declaration.module,
        input_names=declaration.input_names,
        output_names=declaration.output_names,
        dims=_bound_dims(cfg.name, declaration, dynamic),
        make_inputs=declaration.make_inputs,
    )


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


def source_files(cfg: ModelConfig) -> list[Path]:
    """Files the model is read from besides its config: a checkpoint's, or a custom factory's
    own source file. A file rewritten in place makes another model."""
    checkpoint = getattr(cfg, "checkpoint", None)
    if checkpoint:
        return sorted(path for path in Path(checkpoint).rglob("*") if path.is_file())
    if isinstance(cfg, CustomModelConfig):
        return [custom.source_file(cfg)]
    return []
