"""quantize=auto's plan beside every uniform recipe, on one model: the bytes of the planned
layers' weights and the quality (against the float model, in eager at the model's dtype, on the
rows quality is judged on) of each uniform recipe the backend has, and of the plan the search
finds within the budget, as the quantize stage plans it (exporter/quantize/plan.py).

    python bench/plan_vs_uniform.py model=hf model.checkpoint=DIR model.kv_cache=static \\
        backend=aoti quantize.budget.max_kld=0.01
    python bench/plan_vs_uniform.py model=llama_1b model.dtype=float32 model.kv_cache=static \\
        backend=aoti quantize.budget.max_kld=0.002

The arguments are a job's overrides (quantize=auto is implied). A GGUF checkpoint's layers are
planned from its own codes where a recipe holds them, as in a job; the uniform rows quantize
every unit with one recipe from its weight, the file's codes where that recipe holds them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter import config, models
from exporter.command.schemas import register_schemas
from exporter.quantize import plan, quality, recipes

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def main(argv: Sequence[str] | None = None) -> int:
    overrides = [*(sys.argv[1:] if argv is None else argv), "quantize=auto", "mlflow=off"]
    register_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        job = config.to_job(compose("config", overrides=overrides))
    bundle = models.build(job.model, job.dynamic)
    stored = {}
    if bundle.file_quantization is not None:
        stored = bundle.file_quantization().by_layer(bundle.module)
    recipe_names = job.backend.quantize_recipes()
    units = plan.units(bundle.module, recipe_names, stored, job.quantize.skip)
    text, on_text = quality.eval_rows(bundle, job.quantize.eval_text, job.validate.seed)
    measure = plan.Measure(bundle.module, quality.logits_runner(bundle), text.rows)
    budget = job.quantize.budget
    print(
        f"{len(units)} layers planned, measured on {text.positions} positions of {text.source}; "
        f"budget: KLD at most {budget.max_kld:g}"
        + (f", top-1 at least {budget.min_top1:g}" if on_text else " (top-1 not judged)")
    )
    rows = []
    for name in recipe_names:
        recipe = recipes.RECIPES[name]
        applies = [unit for unit in units if recipe in unit.candidates]
        if len(applies) < len(units):
            continue
        started = time.perf_counter()
        found = measure({unit: recipe for unit in units})
        rows.append(
            _row(
                f"uniform {name}",
                sum(recipe.nbytes(unit.layer, unit.logits) for unit in units),
                found,
                plan.within(found, budget, on_text),
                time.perf_counter() - started,
            )
        )
    started = time.perf_counter()
    planned = plan.search(units, measure, budget, on_text)
    rows.append(
        _row(
            f"plan ({planned.wholes_measured} wholes, {planned.units_measured} layers measured)",
            sum(choice.bytes for choice in planned.choices),
            planned.quality,
            planned.within_budget,
            time.perf_counter() - started,
        )
    )
    headers = ["", "MB", "KLD mean", "KLD p99", "top-1", "within budget", "seconds"]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    print("\n".join(planned.lines()))
    return 0


def _row(
    label: str, nbytes: int, found: quality.NextToken, within: bool, seconds: float
) -> list[str]:
    return [
        label,
        f"{nbytes / 1e6:.1f}",
        f"{found.kld_mean:.4g}",
        f"{found.kld_p99:.4g}",
        f"{found.top1:.4f}",
        "yes" if within else "no",
        f"{seconds:.0f}",
    ]


if __name__ == "__main__":
    sys.exit(main())
