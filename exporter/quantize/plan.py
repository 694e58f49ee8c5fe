"""`quantize=auto`: a recipe per layer (exporter/quantize/recipes.py) that keeps the quantized
model within `quantize.budget` at the fewest bytes, measured against the float model on text.

The units planned are the model's linear layers, and a token embedding that no output projection
shares (a tied one takes its projection's table: one table, as the file had). A unit's
candidates are the recipes the backend lists that apply to it; a layer a GGUF checkpoint stored
quantized keeps the file's own codes where a recipe holds them (else none coarser than the
file's), so the file's decisions stand and only what it left float, or what the backend cannot
hold, is chosen.

The search, each model measured in eager at its dtype on the text's token rows:

1. Every unit at its smallest candidate, measured whole: within the budget, that is the plan (a
   GGUF file whose codes the backend holds is measured once and kept).
2. Else each unit alone at each of its candidates, the rest of the model float (the attribution
   of exporter/quantize/attribution.py, per candidate): what it costs in mean KL divergence.
3. From the smallest plan, the upgrade that removes the most KL divergence per byte added, again
   and again, until the costs added up reach the target (the budget's max_kld), then the whole
   plan measured. The costs of layers quantized together do not add up exactly: where the whole
   misses the budget (KL divergence or top-1), the target is lowered in proportion and the
   search goes on, at most ROUNDS times.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from exporter.config import QualityBudget
from exporter.models.gguf_codes import StoredCodes
from exporter.process import progress
from exporter.quantize import recipes
from exporter.quantize.quality import NextToken, PerPosition, per_position

log = logging.getLogger(__name__)

# Whole plans measured after the first, at most.
ROUNDS = 6
# The rows of the text each unit's cost alone is measured on: the costs rank the units, which
# fewer positions do as well, at a fraction of the forward passes.
COST_ROWS = 2


# Compared and hashed by identity: a unit holds a layer and its tensors.
@dataclass(frozen=True, eq=False)
class Unit:
    """A layer the plan gives a recipe: its name in the model, the float layer, the codes a
    checkpoint stored for it, its candidate recipes (fewest bytes first), and the embedding that
    looks its rows up in its weight, if one does."""

    name: str
    layer: torch.nn.Module
    stored: StoredCodes | None
    candidates: tuple[recipes.Recipe, ...]
    tied_embedding: str | None = None
    # The model's output projection: its outputs are the logits decoding ranks.
    logits: bool = False

    def nbytes(self, index: int) -> int:
        return self.candidates[index].nbytes(self.layer, self.logits)


@dataclass(frozen=True)
class Choice:
    """One unit's recipe in a plan, what it starts from (a file's codes, or the float weight),
    and what its weight takes."""

    layer: str
    recipe: str
    source: str
    bytes: int


@dataclass(frozen=True)
class Plan:
    """The recipe of every unit, the quality of the quantized model in eager against the float
    model on the text, whether that is within the budget, and how many whole plans and single
    units were measured to find it."""

    choices: tuple[Choice, ...]
    quality: NextToken
    within_budget: bool
    wholes_measured: int
    units_measured: int

    def recipe_of(self) -> dict[str, str]:
        return {choice.layer: choice.recipe for choice in self.choices}

    def by_recipe(self) -> dict[str, dict[str, int]]:
        """Per recipe and source (`int4 from file Q4_1`): layers and bytes."""
        table: dict[str, dict[str, int]] = {}
        for choice in self.choices:
            row = table.setdefault(f"{choice.recipe} from {choice.source}", {"layers": 0})
            row["layers"] += 1
            row["bytes"] = row.get("bytes", 0) + choice.bytes
        return table

    def summary(self) -> str:
        """`plan: 101.8 MB of weights, int4 from file Q4_1 x210, int8 from file Q8_0 x1`."""
        parts = [f"{name} x{row['layers']}" for name, row in self.by_recipe().items()]
        total = sum(choice.bytes for choice in self.choices)
        return f"plan: {total / 1e6:.1f} MB of weights, {', '.join(parts)}"

    def lines(self) -> list[str]:
        quality = self.quality
        verdict = "within" if self.within_budget else "NOT within"
        lines = [
            f"plan: {len(self.choices)} layers, {self.wholes_measured} whole plans and "
            f"{self.units_measured} single layers measured; the quantized model in eager "
            f"against the float model: KLD mean {quality.kld_mean:.3g}, top-1 "
            f"{quality.top1:.3g} ({verdict} the budget)"
        ]
        lines += [
            f"  {name}: {row['layers']} layers, {row['bytes'] / 1e6:.1f} MB"
            for name, row in self.by_recipe().items()
        ]
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "choices": [asdict(choice) for choice in self.choices],
            "quality": self.quality.to_json(),
            "within_budget": self.within_budget,
            "wholes_measured": self.wholes_measured,
            "units_measured": self.units_measured,
            "by_recipe": self.by_recipe(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        return cls(
            tuple(Choice(**choice) for choice in data["choices"]),
            NextToken(**data["quality"]),
            bool(data["within_budget"]),
            int(data["wholes_measured"]),
            int(data["units_measured"]),
        )


def units(
    module: torch.nn.Module,
    recipe_names: tuple[str, ...],
    stored: Mapping[str, StoredCodes],
    skip: Sequence[str],
) -> list[Unit]:
    """The units of `module` that have a choice: its linear layers and untied embeddings, less
    `skip`, each with the candidates of `recipe_names` (`stored`: a checkpoint's codes by layer
    name)."""
    layers = dict(module.named_modules())
    output = output_projection(module)
    embedding_of = {
        id(layer.weight): name
        for name, layer in layers.items()
        if isinstance(layer, torch.nn.Embedding)
    }
    tied = set()
    found = []
    for name, layer in layers.items():
        if type(layer) is not torch.nn.Linear or name in skip:
            continue
        embedding = embedding_of.get(id(layer.weight))
        if embedding is not None:
            tied.add(embedding)
        found.append((name, layer, embedding))
    for name, layer in layers.items():
        if isinstance(layer, torch.nn.Embedding) and name not in tied and name not in skip:
            found.append((name, layer, None))
    planned = []
    for name, layer, embedding in found:
        codes = stored.get(name) or (stored.get(embedding) if embedding else None)
        candidates = recipes.candidates(recipe_names, layer, codes)
        if len(candidates) > 1 or (candidates and candidates[0].name != "float"):
            planned.append(
                Unit(name, layer, codes, tuple(candidates), embedding, logits=layer is output)
            )
    return planned


def output_projection(module: torch.nn.Module) -> torch.nn.Module | None:
    """The output projection of the transformers model inside `module`, if there is one."""
    for submodule in module.modules():
        output = getattr(submodule, "get_output_embeddings", None)
        if callable(output):
            return output()
    return None


def replacements(unit: Unit, recipe: recipes.Recipe) -> dict[str, torch.nn.Module]:
    """The modules that stand in for `unit` under `recipe` (its tied embedding too, where the
    recipe's table can be looked up), by name; nothing for float."""
    if recipe.name == "float":
        return {}
    quantized = recipe.quantized(unit.layer, unit.stored, unit.logits)
    swapped = {unit.name: quantized}
    if unit.tied_embedding is not None and isinstance(recipe, recipes.Packed):
        from exporter.quantize.packed import PackedEmbedding

        embedding_dtype = unit.layer.weight.dtype
        swapped[unit.tied_embedding] = PackedEmbedding(quantized, embedding_dtype)
    return swapped


@contextlib.contextmanager
def swapped(module: torch.nn.Module, modules: Mapping[str, torch.nn.Module]) -> Iterator[None]:
    """`module` with `modules` in place of its submodules of those names, for the block."""
    originals = {name: module.get_submodule(name) for name in modules}
    try:
        for name, replacement in modules.items():
            module.set_submodule(name, replacement)
        yield
    finally:
        for name, original in originals.items():
            module.set_submodule(name, original)


class Measure:
    """The quality of `module` with some units quantized, against the float model, on token
    rows: `run(rows)` returns the logits [n, vocab] of each row (the model without a cache)."""

    def __init__(
        self,
        module: torch.nn.Module,
        run: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]],
        rows: Sequence[torch.Tensor],
    ) -> None:
        self.module = module
        self.run = run
        self.rows = list(rows)
        self.float_logits = run(self.rows)
        self.copies: dict[tuple[str, str], dict[str, torch.nn.Module]] = {}

    def __call__(self, plan: Mapping[Unit, recipes.Recipe], rows: int | None = None) -> NextToken:
        chosen = self.rows[:rows]
        modules: dict[str, torch.nn.Module] = {}
        for unit, recipe in plan.items():
            key = (unit.name, recipe.name)
            if key not in self.copies:
                self.copies[key] = replacements(unit, recipe)
            modules.update(self.copies[key])
        with swapped(self.module, modules):
            logits = self.run(chosen)
        measured = [per_position(f, q) for f, q in zip(self.float_logits, logits, strict=False)]
        return NextToken.of(PerPosition.concat(measured))


def within(quality: NextToken, budget: QualityBudget, on_text: bool) -> bool:
    """Whether `quality` meets the budget (top-1 judged on text only: QualityBudget)."""
    return quality.kld_mean <= budget.max_kld and (not on_text or quality.top1 >= budget.min_top1)


def search(planned: Sequence[Unit], measure: Measure, budget: QualityBudget, on_text: bool) -> Plan:
    """The plan of fewest bytes that `measure` finds within `budget` (the module docstring)."""
    chosen = {unit: 0 for unit in planned}
    progress.doing("measuring the smallest plan")
    quality = measure(_recipes(chosen))
    wholes, singles = 1, 0
    if within(quality, budget, on_text) or not planned:
        return _plan(chosen, quality, budget, on_text, wholes, singles)
    cost: dict[tuple[Unit, int], float] = {}
    for number, unit in enumerate(planned):
        progress.doing(f"measuring each layer alone: {number + 1} of {len(planned)}")
        for index, recipe in enumerate(unit.candidates):
            if recipe.name == "float":
                cost[unit, index] = 0.0
                continue
            cost[unit, index] = measure({unit: recipe}, rows=COST_ROWS).kld_mean
            singles += 1
    target = budget.max_kld
    while True:
        predicted = sum(cost[unit, index] for unit, index in chosen.items())
        while predicted > target:
            step = _best_upgrade(chosen, cost)
            if step is None:
                break
            predicted += cost[step, chosen[step] + 1] - cost[step, chosen[step]]
            chosen[step] += 1
        progress.doing(f"measuring plan {wholes + 1} (costs added up: KLD {predicted:.3g})")
        quality = measure(_recipes(chosen))
        wholes += 1
        log.info(
            "[quantize] plan %d: KLD mean %.3g (layers' costs added up: %.3g), top-1 %.3g",
            wholes,
            quality.kld_mean,
            predicted,
            quality.top1,
        )
        exhausted = _best_upgrade(chosen, cost) is None
        if within(quality, budget, on_text) or exhausted or wholes > ROUNDS:
            return _plan(chosen, quality, budget, on_text, wholes, singles)
        # Aim lower by what the whole missed: its KL divergence over the budget's, or half as
        # much again where the top-1 floor failed.
        shortfall = max(quality.kld_mean / max(budget.max_kld, 1e-12), 2.0)
        target = min(target, predicted) / shortfall


def _best_upgrade(
    chosen: Mapping[Unit, int], cost: Mapping[tuple[Unit, int], float]
) -> Unit | None:
    """The unit whose next candidate removes the most KL divergence per byte added."""
    best, best_rate = None, 0.0
    for unit, index in chosen.items():
        if index + 1 >= len(unit.candidates):
            continue
        gained = cost[unit, index] - cost[unit, index + 1]
        added = max(unit.nbytes(index + 1) - unit.nbytes(index), 1)
        rate = gained / added
        if best is None or rate > best_rate:
            best, best_rate = unit, rate
    return best


def _recipes(chosen: Mapping[Unit, int]) -> dict[Unit, recipes.Recipe]:
    return {unit: unit.candidates[index] for unit, index in chosen.items()}


def _plan(
    chosen: Mapping[Unit, int],
    quality: NextToken,
    budget: QualityBudget,
    on_text: bool,
    wholes: int,
    singles: int,
) -> Plan:
    choices = []
    for unit, index in chosen.items():
        recipe = unit.candidates[index]
        source = "float weights"
        if recipe.holds(unit.stored):
            assert unit.stored is not None
            source = f"file {unit.stored.ggml_type}"
        elif unit.stored is not None and recipe.name != "float":
            source = f"file {unit.stored.ggml_type}, dequantized"
        choices.append(Choice(unit.name, recipe.name, source, unit.nbytes(index)))
    return Plan(tuple(choices), quality, within(quality, budget, on_text), wholes, singles)


def apply(
    module: torch.nn.Module, plan: Plan, planned: Sequence[Unit]
) -> dict[str, torch.nn.Module]:
    """The modules `plan` puts in `module` (its quantized copy), by name, put there."""
    by_name = {unit.name: unit for unit in planned}
    placed: dict[str, torch.nn.Module] = {}
    for choice in plan.choices:
        unit = by_name.get(choice.layer)
        if unit is None:
            raise ValueError(f"the plan names {choice.layer}, which the model does not have")
        placed.update(replacements(unit, recipes.RECIPES[choice.recipe]))
    for name, replacement in placed.items():
        module.set_submodule(name, replacement)
    return placed
