"""The quantize stage: the model's linear layers (and, where asked, its token embedding)
quantized with torchao, in place on a copy, the float model kept beside it; with
`quantize=auto`, each layer by the recipe of a plan (exporter/quantize/plan.py), a GGUF
checkpoint's own codes kept where the backend holds them.

A backend that computes `quantize=int4_weight` with PyTorch's int4 kernel (aoti:
`BackendConfig.int4_weight_packed`) gets the packed `int4` recipe of the group size wherever the
kernel takes the layer (exporter/quantize/packed.py), torchao's layer elsewhere.

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
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchao.quantization import IntxUnpackedToInt8Tensor, quantize_

from exporter.config import EmbeddingQuant, QuantizeConfig, QuantScheme
from exporter.models.bundle import ModelBundle
from exporter.quantize import plan as plans
from exporter.quantize import recipes
from exporter.quantize.packed import PackedEmbedding, PackedLinear
from exporter.quantize.recipes import embedding_config, linear_config

log = logging.getLogger(__name__)


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
    plan: plans.Plan | None = None
    # Of the linear layers, those PyTorch's int4 kernel computes (packed.py).
    packed_layers: int = 0

    def line(self) -> str:
        if self.plan is not None:
            return "\n".join(
                [
                    f"quantized by plan: {self.linear_layers} linear layers, "
                    f"{self.embedding_layers} embedding",
                    *self.plan.lines(),
                ]
            )
        text = (
            f"quantized: {self.scheme}, group {self.group_size}, {self.linear_layers} linear layers"
        )
        if self.packed_layers:
            text += f" ({self.packed_layers} through PyTorch's int4 kernel)"
        text += f", embedding {self.embedding}"
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
        found = dataclasses.asdict(self)
        found["plan"] = self.plan and self.plan.to_json()
        return found


def quantized(
    bundle: ModelBundle,
    cfg: QuantizeConfig,
    group_scales: str | None = None,
    int4_weight_packed: bool = False,
) -> ModelBundle:
    """`bundle` with its module quantized as `cfg` says; its `unquantized` is the float model.
    The module is quantized in place on a copy: the decoder's uncached model shares its layers,
    so it is quantized alike. The copy has modules and buffers of its own (a KV cache is written
    as the model runs) but the float model's parameters: quantizing gives a layer a new weight
    rather than changing the old one, so what stays float (the embedding, the norms, skipped
    layers) is held once, not twice (1.05 GB of `llama_1b`'s embedding in float32), and the
    copy costs no float model's worth at its peak. `group_scales`: the dtype (a torch dtype's
    name) the per-group weight scales are rounded to, for a backend that reads them so;
    `int4_weight_packed`: int4_weight's layers are PyTorch's int4 kernel's where it takes them
    (exporter/quantize/packed.py), torchao's elsewhere."""
    float_bundle = bundle
    bundle = _copy_sharing_parameters(bundle)
    skipped = frozenset(cfg.skip)
    if int4_weight_packed and cfg.scheme is QuantScheme("int4_weight"):
        _packed_int4(bundle.module, cfg)
    if cfg.scheme is not QuantScheme.none:
        quantize_(bundle.module, linear_config(cfg), filter_fn=_linear_filter(skipped))
    if cfg.embedding is not EmbeddingQuant.none:
        quantize_(bundle.module, embedding_config(cfg), filter_fn=_embedding_filter(skipped))
    if group_scales is not None:
        for weight in _per_group(bundle.module):
            weight.scale.copy_(weight.scale.to(getattr(torch, group_scales)))
    return dataclasses.replace(bundle, unquantized=float_bundle)


def planned(
    bundle: ModelBundle,
    cfg: QuantizeConfig,
    recipe_names: tuple[str, ...],
    measure: Callable[[], plans.Measure],
    on_text: bool,
    found: plans.Plan | None = None,
    group_scales: str | None = None,
) -> tuple[ModelBundle, plans.Plan]:
    """`bundle` with each layer quantized by the plan (`found`, or one searched with what
    `measure()` makes: exporter/quantize/plan.py), the layers a GGUF checkpoint stored quantized
    from its own codes where a recipe holds them; its `unquantized` is the float model."""
    stored = {}
    if bundle.file_quantization is not None:
        read = bundle.file_quantization()
        stored = read.by_layer(bundle.module)
        for skipped in read.not_carried:
            log.info(
                "[quantize] %s: not carried from %s, planned from its dequantized weight",
                skipped.line(),
                read.file.name,
            )
    units = plans.units(bundle.module, recipe_names, stored, cfg.skip)
    if found is None:
        found = plans.search(units, measure(), cfg.budget, on_text)
    float_bundle = bundle
    bundle = _copy_sharing_parameters(bundle)
    plans.apply(bundle.module, found, units)
    if group_scales is not None:
        for weight in _per_group(bundle.module):
            weight.scale.copy_(weight.scale.to(getattr(torch, group_scales)))
    return dataclasses.replace(bundle, unquantized=float_bundle), found


def _packed_int4(module: torch.nn.Module, cfg: QuantizeConfig) -> None:
    """Every linear layer of `module` (less `cfg.skip`) that the int4 kernel takes, made a
    packed one of `cfg.group_size` in place; an output projection's tied embedding looks its
    rows up in the projection's table (exporter/quantize/plan.py: one table, not two)."""
    recipe = recipes.packed_int4(cfg.group_size)
    for unit in plans.units(module, (recipe.name,), {}, cfg.skip):
        if isinstance(unit.layer, torch.nn.Linear):
            for name, replacement in plans.replacements(unit, recipe).items():
                module.set_submodule(name, replacement)


def _copy_sharing_parameters(bundle: ModelBundle) -> ModelBundle:
    """A copy of the bundle with modules and buffers of its own (a KV cache is written as the
    model runs) and the float model's parameters (module docstring of `quantized`)."""
    modules = [bundle.module, *([bundle.decoder.uncached] if bundle.decoder else [])]
    shared = {id(p): p for module in modules for p in module.parameters()}
    return copy.deepcopy(bundle, memo=shared)


def summary(
    module: torch.nn.Module,
    cfg: QuantizeConfig,
    group_scales: str | None = None,
    plan: plans.Plan | None = None,
) -> Quantization:
    """What `quantized` (or `planned`, by `plan`) made of `module`: the layers whose weights it
    quantized."""
    linear = embedding = packed = 0
    for submodule in module.modules():
        if isinstance(submodule, PackedLinear) or (
            type(submodule) is torch.nn.Linear and _is_quantized(submodule)
        ):
            linear += 1
            packed += isinstance(submodule, PackedLinear)
        elif isinstance(submodule, PackedEmbedding) or (
            type(submodule) is torch.nn.Embedding and _is_quantized(submodule)
        ):
            embedding += 1
    return Quantization(
        scheme=cfg.scheme.value,
        group_size=cfg.group_size,
        linear_layers=linear,
        embedding="planned" if plan else cfg.embedding.value,
        embedding_layers=embedding,
        skipped=tuple(cfg.skip),
        scales_rounded_to=group_scales if _per_group(module) else None,
        plan=plan,
        packed_layers=packed,
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


def _linear_filter(skipped: frozenset[str]):
    def chosen(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and name not in skipped

    return chosen


def _embedding_filter(skipped: frozenset[str]):
    def chosen(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Embedding) and name not in skipped

    return chosen
