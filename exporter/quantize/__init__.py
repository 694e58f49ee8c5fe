"""The quantize stage: the model's linear layers (and, where asked, its token embedding)
quantized with torchao, in place on a copy, the float model kept beside it.

The quantized module is what export, the goldens and the audit see from here on. The float model
rides along as `ModelBundle.unquantized`, for the verdict on what quantization costs (quality),
which is judged apart from what lowering adds (fidelity).

A backend whose kernels read per-group weight scales in another dtype than the model's (XNNPACK:
bfloat16) gets them rounded so here, before export: the quantized model the fidelity verdict
judges the artifact against is then the one the artifact computes, and the rounding's cost is
quantization's, which quality measures against the float model."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torchao.quantization import (
    Int8DynamicActivationIntxWeightConfig,
    IntxUnpackedToInt8Tensor,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.granularity import PerAxis, PerGroup

from exporter.config import EmbeddingQuant, QuantizeConfig, QuantScheme
from exporter.models.bundle import ModelBundle


@dataclass(frozen=True)
class Quantization:
    """What the quantize stage did, for the log and report.json: the scheme and its group, the
    layers it quantized and those `skip` kept in float, and the dtype the per-group scales were
    rounded to for the backend (None: left as torchao chose them)."""

    scheme: str
    group_size: int
    linear_layers: int
    embedding: str
    embedding_layers: int
    skipped: tuple[str, ...]
    scales_rounded_to: str | None

    def line(self) -> str:
        text = (
            f"quantized: {self.scheme}, group {self.group_size}, {self.linear_layers} linear "
            f"layers, embedding {self.embedding}"
        )
        if self.embedding != EmbeddingQuant.none.value:
            text += f" ({self.embedding_layers} layer{'s' * (self.embedding_layers != 1)})"
        if self.skipped:
            text += f", kept in float: {', '.join(self.skipped)}"
        if self.scales_rounded_to:
            text += (
                f"; per-group scales rounded to {self.scales_rounded_to}, as the backend's "
                "kernels read them, so the quantized model is what the artifact computes"
            )
        return text

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def quantized(
    bundle: ModelBundle, cfg: QuantizeConfig, group_scales: str | None = None
) -> ModelBundle:
    """`bundle` with its module quantized as `cfg` says; its `unquantized` is the float model.
    The module is quantized in place on a copy: the decoder's uncached model shares its layers,
    so it is quantized alike. The copy has modules and buffers of its own (a KV cache is written
    as the model runs) but the float model's parameters: quantizing gives a layer a new weight
    rather than changing the old one, so what stays float (the embedding, the norms, skipped
    layers) is held once, not twice (1.05 GB of `llama_1b`'s embedding in float32), and the
    copy costs no float model's worth at its peak. `group_scales`: the dtype (a torch dtype's
    name) the per-group weight scales are rounded to, for a backend that reads them so."""
    float_bundle = bundle
    modules = [bundle.module, *([bundle.decoder.uncached] if bundle.decoder else [])]
    shared = {id(p): p for module in modules for p in module.parameters()}
    bundle = copy.deepcopy(bundle, memo=shared)
    skipped = frozenset(cfg.skip)
    if cfg.scheme is not QuantScheme.none:
        quantize_(bundle.module, linear_config(cfg), filter_fn=_linear_filter(skipped))
    if cfg.embedding is not EmbeddingQuant.none:
        quantize_(bundle.module, embedding_config(cfg), filter_fn=_embedding_filter(skipped))
    if group_scales is not None:
        for weight in _per_group(bundle.module):
            weight.scale.copy_(weight.scale.to(getattr(torch, group_scales)))
    return dataclasses.replace(bundle, unquantized=float_bundle)


def summary(
    module: torch.nn.Module, cfg: QuantizeConfig, group_scales: str | None = None
) -> Quantization:
    """What `quantized` made of `module`: the layers whose weights it quantized."""
    layers = {torch.nn.Linear: 0, torch.nn.Embedding: 0}
    for submodule in module.modules():
        if type(submodule) in layers and _is_quantized(submodule):
            layers[type(submodule)] += 1
    return Quantization(
        scheme=cfg.scheme.value,
        group_size=cfg.group_size,
        linear_layers=layers[torch.nn.Linear],
        embedding=cfg.embedding.value,
        embedding_layers=layers[torch.nn.Embedding],
        skipped=tuple(cfg.skip),
        scales_rounded_to=group_scales if _per_group(module) else None,
    )


def _is_quantized(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "weight", None), IntxUnpackedToInt8Tensor)


def _per_group(module: torch.nn.Module) -> list[IntxUnpackedToInt8Tensor]:
    """The quantized weights of `module`'s linear layers whose scales are per group (a block
    narrower than a row), each once (a tied weight is one)."""
    weights = {}
    for submodule in module.modules():
        if type(submodule) is torch.nn.Linear and _is_quantized(submodule):
            weight = submodule.weight
            if weight.block_size[-1] < weight.shape[-1]:
                weights[id(weight)] = weight
    return list(weights.values())


def linear_config(cfg: QuantizeConfig) -> object:
    """torchao's configuration of `cfg`'s scheme for a linear layer (attribution applies it to
    one layer at a time)."""
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


def embedding_config(cfg: QuantizeConfig) -> IntxWeightOnlyConfig:
    """torchao's configuration of `cfg.embedding` for the token embedding's table."""
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
