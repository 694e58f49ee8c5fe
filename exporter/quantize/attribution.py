"""Which layers cost the most quality (quantize.attribution=on): each quantizable layer quantized
alone, the rest of the model float, on the rows quality is judged on (exporter/quantize/
quality.py's text).

Per layer rather than per decoder block: quantize.skip takes the names of the modules that
quantization replaces (linear layers, the token embedding), so a layer's figure comes with the
override that keeps it float. Quantized alone rather than kept float alone: a layer's own cost
is then measured against nothing but the float model, where keeping one layer float among
dozens quantized changes the whole model's figure by less than the differences between layers.
The model runs in eager at its dtype, each layer's quantized copy swapped in and out of the float
model; nothing is lowered per layer, so the figures are the quantized model's, not an artifact's.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torchao.quantization import quantize_

from exporter.config import EmbeddingQuant, QuantizeConfig, QuantScheme
from exporter.models import ModelBundle
from exporter.quantize import plan as plans
from exporter.quantize import quality, recipes
from exporter.quantize.quality import NextToken, PerPosition, per_position
from exporter.quantize.recipes import embedding_config, linear_config
from runtimes.verdict.goldens import Goldens

log = logging.getLogger(__name__)

# The layers listed, worst first.
WORST = 5


@dataclass(frozen=True)
class Layer:
    """One layer's cost: the model's quality with it alone quantized, against the float model."""

    name: str
    quality: NextToken

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, **self.quality.to_json()}


@dataclass(frozen=True)
class Attribution:
    """Every quantizable layer's cost, worst (largest mean KL divergence) first."""

    layers: tuple[Layer, ...]

    def worst(self, count: int = WORST) -> tuple[Layer, ...]:
        return self.layers[:count]

    def worst_names(self, count: int = WORST) -> list[str]:
        return [layer.name for layer in self.worst(count)]

    def override(self, count: int = WORST) -> str:
        """The override that keeps the worst layers float."""
        return f"quantize.skip=[{','.join(self.worst_names(count))}]"

    def lines(self) -> list[str]:
        lines = [
            f"attribution: {len(self.layers)} layers, each quantized alone in eager at the "
            "model's dtype (no lowering per layer); the costliest, by mean KL divergence "
            "against the float model:"
        ]
        lines += [
            f"  {layer.name}: KLD mean {layer.quality.kld_mean:.3g}, max "
            f"{layer.quality.kld_max:.3g}, top-1 {layer.quality.top1:.3g}"
            for layer in self.worst()
        ]
        lines.append(f"to keep them float: {self.override()}")
        return lines

    def to_json(self) -> dict[str, object]:
        return {
            "measured_on": "each layer quantized alone, in eager at the model's dtype, on the "
            "rows quality is judged on, against the float model at its dtype",
            "override": self.override(),
            "layers": [layer.to_json() for layer in self.layers],
        }


def attribute(
    module: torch.nn.Module,
    run: Callable[[], Sequence[torch.Tensor]],
    cfg: QuantizeConfig,
    int4_weight_packed: bool = False,
) -> Attribution:
    """Each layer of the float `module` that `cfg` quantizes, quantized alone as the quantize
    stage quantizes it (`int4_weight_packed`: as exporter/quantize/__init__.py says): `run()`
    calls the model (sharing `module`'s layers) on the quality rows and returns its logits, one
    tensor per input; the layer goes back to float after."""
    reference = [logits.detach().to(torch.float64) for logits in run()]
    layers = []
    for name, layer, quantized_copy in _quantizable(module, cfg, int4_weight_packed):
        quantized = quantized_copy(layer)
        module.set_submodule(name, quantized)
        try:
            outputs = run()
        finally:
            module.set_submodule(name, layer)
        measured = PerPosition.concat(
            [per_position(f, q) for f, q in zip(reference, outputs, strict=True)]
        )
        layers.append(Layer(name, NextToken.of(measured)))
        log.debug("[attribution] %s: KLD mean %.3g", name, layers[-1].quality.kld_mean)
    layers.sort(key=lambda found: found.quality.kld_mean, reverse=True)
    return Attribution(tuple(layers))


def _quantizable(
    module: torch.nn.Module, cfg: QuantizeConfig, int4_weight_packed: bool
) -> list[tuple[str, torch.nn.Module, Callable[[torch.nn.Module], torch.nn.Module]]]:
    """(name, layer, what makes its quantized copy) of every layer `cfg` quantizes, as the
    quantize stage chooses them (exporter/quantize/__init__.py): linear layers and, where asked,
    embeddings, less those in quantize.skip."""
    skipped = set(cfg.skip)
    packed = None
    if int4_weight_packed and cfg.scheme is QuantScheme("int4_weight"):
        packed = recipes.packed_int4(cfg.group_size)
    output = plans.output_projection(module)
    chosen = []
    for name, layer in module.named_modules():
        if name in skipped:
            continue
        if isinstance(layer, torch.nn.Linear) and cfg.scheme is not QuantScheme.none:
            if packed is not None and packed.applies(layer):
                logits = layer is output
                chosen.append((name, layer, functools.partial(_packed, packed, logits=logits)))
            else:
                chosen.append((name, layer, functools.partial(_alone, linear_config(cfg))))
        elif isinstance(layer, torch.nn.Embedding) and cfg.embedding is not EmbeddingQuant.none:
            chosen.append((name, layer, functools.partial(_alone, embedding_config(cfg))))
    return chosen


def _packed(recipe: recipes.Packed, layer: torch.nn.Module, logits: bool) -> torch.nn.Module:
    return recipe.quantized(layer, None, logits)


def _alone(config: object, layer: torch.nn.Module) -> torch.nn.Module:
    """A quantized copy of `layer`; the float layer is left as it is."""
    holder = torch.nn.Sequential(copy.deepcopy(layer))
    quantize_(holder, config)
    return holder[0]


def on_quality_rows(float_bundle: ModelBundle, goldens: Goldens) -> Callable[[], list]:
    """What `attribute` runs: the float model's logits at its dtype on the rows quality is
    judged on (the text, or a model without a tokenizer's random token ids), through its model
    without a cache; a model whose quality is not measured on rows (not a causal LM) on the
    job's validation inputs."""
    if goldens.text:
        rows = goldens.text["rows"]
        run = quality.logits_runner(float_bundle)
        return lambda: run(rows)
    index = goldens.logits.index(True)
    cases = [inputs for inputs, _ in goldens.cases.values()]

    def shapes() -> list[torch.Tensor]:
        with torch.no_grad():
            return [pytree.tree_leaves(float_bundle.module(*inputs))[index] for inputs in cases]

    return shapes
