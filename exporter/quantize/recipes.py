"""The ways `quantize=auto` can quantize one layer, by the names backends list
(`BackendConfig.quantize_recipes`): each makes a layer's quantized copy, from its float weight or
from a checkpoint's own codes where it holds them, and says what the copy's weight takes.

- `int4`: 4-bit codes per group of 32, asymmetric, the grid's range searched per group
  (`int4_g64`, `int4_g128`, `int4_g256`: per wider group, fewer scales), and `int8`: 8-bit
  codes per group of 32, symmetric (llama.cpp's Q8_0), as two 4-bit planes; all with bfloat16
  scales and zeros and bfloat16 activations at the matmul, through PyTorch's packed int4 kernel
  for the CPU (exporter/quantize/packed.py): eager on the CPU, and aoti, whose lowering for CUDA
  repacks them for CUDA's int4 kernel; aoti computes `quantize=int4_weight` with the `int4`
  recipe of `quantize.group_size`;
- `8da4w`, `8da8w`: torchao's layers with int8 activations per token: executorch (XNNPACK);
- `int4_weight`, `int8_weight`: torchao's weight-only layers: eager on CUDA;
- `float`: the layer as it is, on every backend.

`int4` holds a GGUF file's Q4_0, Q4_1 and Q4_K codes and `int8` its Q8_0 codes exactly (scales
rounded to bfloat16); no recipe holds Q6_K's 16-wide groups, which are rounded again at 8 bits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torchao.quantization import (
    Int8DynamicActivationIntxWeightConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.granularity import PerAxis, PerGroup

from exporter.config import EmbeddingQuant, QuantizeConfig, QuantScheme
from exporter.models.gguf_codes import StoredCodes
from exporter.quantize import packed

_GROUP = 32
# An output projection's largest logits of each position computed again at the model's dtype
# (exporter/quantize/packed.py). SmolLM2's Q4_1 file on 640 positions of text: top-1 0.998 with
# 8, 16 or 64 of them (0.977 with none), KLD 6.8e-4, 6.1e-4, 5.1e-4.
EXACT_TOP = 16


@dataclass(frozen=True)
class Recipe:
    """One way to quantize a layer; `bits` orders recipes (float: the model's own)."""

    name: str
    bits: int

    def applies(self, layer: torch.nn.Module) -> bool:
        """Whether it can quantize `layer` at all."""
        return True

    def holds(self, stored: StoredCodes | None) -> bool:
        """Whether it carries the codes `stored` as they are."""
        return False

    def nbytes(self, layer: torch.nn.Module, logits: bool = False) -> int:
        """What the layer's weight takes under the recipe, in the artifact (`logits`: as the
        model's output projection)."""
        return layer.weight.nbytes

    def quantized(
        self, layer: torch.nn.Module, stored: StoredCodes | None, logits: bool = False
    ) -> torch.nn.Module:
        """The layer's quantized copy (the float layer is left as it is): from `stored` where
        the recipe holds it, else from the layer's float weight; `logits`: the layer is the
        model's output projection, whose outputs decoding ranks."""
        return layer


@dataclass(frozen=True)
class Packed(Recipe):
    """PyTorch's packed int4 kernel for the CPU: `bits` 4 (one plane) or 8 (two), a scale and
    zero per `group` codes of a row."""

    group: int = _GROUP

    def applies(self, layer: torch.nn.Module) -> bool:
        if not isinstance(layer, torch.nn.Linear | torch.nn.Embedding):
            return False
        rows, cols = layer.weight.shape
        return packed.holds(rows, cols, self.group)

    def holds(self, stored: StoredCodes | None) -> bool:
        return stored is not None and stored.bits == self.bits and stored.group == self.group

    def nbytes(self, layer: torch.nn.Module, logits: bool = False) -> int:
        rows, cols = layer.weight.shape
        planes = self.bits // 4
        groups = rows * cols // self.group
        # Each plane: half a byte a code, a bfloat16 scale and zero per group; an output
        # projection keeps a float32 scale and offset per group besides.
        return planes * (rows * cols // 2 + groups * 4) + (groups * 8 if logits else 0)

    def quantized(
        self, layer: torch.nn.Module, stored: StoredCodes | None, logits: bool = False
    ) -> torch.nn.Module:
        bias = getattr(layer, "bias", None)
        bias = None if bias is None else bias.detach().clone()
        exact_top = EXACT_TOP if logits else 0
        if self.holds(stored):
            assert stored is not None
            table = packed.PackedLinear.from_codes(
                stored.codes, stored.scale, stored.offset, self.bits, stored.signed, bias, exact_top
            )
        else:
            table = packed.PackedLinear.from_float(
                layer.weight, self.bits, self.group, bias, exact_top
            )
        if isinstance(layer, torch.nn.Embedding):
            return packed.PackedEmbedding(table, layer.weight.dtype)
        return table


@dataclass(frozen=True)
class Torchao(Recipe):
    """torchao's quantized linear layer of the uniform scheme of the same name."""

    def applies(self, layer: torch.nn.Module) -> bool:
        return type(layer) is torch.nn.Linear

    def nbytes(self, layer: torch.nn.Module, logits: bool = False) -> int:
        rows, cols = layer.weight.shape
        if self.name == "8da8w" or self.name == "int8_weight":
            return rows * cols + rows * 4
        # 8da4w: XNNPACK packs two codes a byte, a bfloat16 scale a group; int4_weight: torchao
        # keeps a code a byte, a scale and a zero point a group.
        per_code = 0.5 if self.name == "8da4w" else 1
        return int(rows * cols * per_code) + rows * cols // _GROUP * 4

    def quantized(
        self, layer: torch.nn.Module, stored: StoredCodes | None, logits: bool = False
    ) -> torch.nn.Module:
        holder = torch.nn.Sequential(copy.deepcopy(layer))
        quantize_(holder, linear_config(QuantizeConfig(scheme=QuantScheme(self.name))))
        return holder[0]


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


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Packed("int4_g256", 4, 256),
        Packed("int4_g128", 4, 128),
        Packed("int4_g64", 4, 64),
        Packed("int4", 4),
        Packed("int8", 8),
        Torchao("8da4w", 4),
        Torchao("int4_weight", 4),
        Torchao("8da8w", 8),
        Torchao("int8_weight", 8),
        Recipe("float", 32),
    )
}


def packed_int4(group: int) -> Packed:
    """The packed int4 recipe of per-group scales over `group` codes (quantize=int4_weight on a
    backend that computes it with PyTorch's int4 kernel)."""
    found = RECIPES["int4" if group == _GROUP else f"int4_g{group}"]
    assert isinstance(found, Packed)
    return found


def candidates(
    names: tuple[str, ...], layer: torch.nn.Module, stored: StoredCodes | None
) -> list[Recipe]:
    """The recipes a plan may give `layer`, fewest bytes first: of `names`, those that apply to
    it; where the checkpoint stored it quantized, none that would round it more coarsely than
    the file did, and where a recipe holds the file's codes, that one and float only (rounding
    exact codes again can only cost)."""
    found = [RECIPES[name] for name in names if RECIPES[name].applies(layer)]
    if stored is not None:
        holding = [recipe for recipe in found if recipe.holds(stored)]
        if holding:
            found = [holding[0], *(r for r in found if r.name == "float")]
        else:
            found = [recipe for recipe in found if recipe.bits >= stored.bits]
    return sorted(found, key=lambda recipe: recipe.nbytes(layer))
