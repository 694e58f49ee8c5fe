"""The quantize stage: the model's linear layers (and, where asked, its token embedding)
quantized with torchao, in place on a copy, the float model kept beside it.

The quantized module is what export, the goldens and the audit see from here on. The float model
rides along as `ModelBundle.unquantized`, for the verdict on what quantization costs (quality),
which is judged apart from what lowering adds (fidelity)."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torchao.quantization import (
    Int8DynamicActivationIntxWeightConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.granularity import PerAxis, PerGroup

from exporter.config import EmbeddingQuant, QuantizeConfig, QuantScheme
from exporter.models.bundle import ModelBundle


def quantized(bundle: ModelBundle, cfg: QuantizeConfig) -> ModelBundle:
    """`bundle` with its module quantized as `cfg` says; its `unquantized` is the float model.
    The module is quantized in place on a copy: the decoder's uncached model shares its layers,
    so it is quantized alike, and the float copy shares nothing with it."""
    float_bundle = bundle
    bundle = copy.deepcopy(bundle)
    skipped = frozenset(cfg.skip)
    if cfg.scheme is not QuantScheme.none:
        quantize_(bundle.module, _linear_config(cfg), filter_fn=_linear_filter(skipped))
    if cfg.embedding is not EmbeddingQuant.none:
        quantize_(bundle.module, _embedding_config(cfg), filter_fn=_embedding_filter(skipped))
    return dataclasses.replace(bundle, unquantized=float_bundle)


def _linear_config(cfg: QuantizeConfig) -> object:
    group = PerGroup(cfg.group_size)
    channel = PerAxis(0)
    if cfg.scheme is QuantScheme("8da4w"):
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=group
        )
    if cfg.scheme is QuantScheme("8da8w"):
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=channel
        )
    if cfg.scheme is QuantScheme("int8_weight"):
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=channel)
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=group)


def _embedding_config(cfg: QuantizeConfig) -> IntxWeightOnlyConfig:
    if cfg.embedding is EmbeddingQuant.int8:
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(cfg.group_size))


def _linear_filter(skipped: frozenset[str]):
    def chosen(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and name not in skipped

    return chosen


def _embedding_filter(skipped: frozenset[str]):
    def chosen(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Embedding) and name not in skipped

    return chosen
