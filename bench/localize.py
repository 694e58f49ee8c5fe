"""What localization costs against one lowering: an XNNPACK job whose lowering has a rewrite
planted that is wrong only below the upper bound (the node comes out scaled by seq / max), run
through its stages in this process, for each model; the figures are the job's own stage times.

    python bench/localize.py                       # model=llama and llama_45m on XNNPACK
    python bench/localize.py --model llama --runs 3
    python bench/localize.py --at first            # planted in the first layer

The planted node is the rsqrt of the last layer's post-attention norm, deep in the program (the
search's worst case: it goes front first), or with `--at first` the first layer's, where a
lowering bug shows first; `found` says whether the search named it. `ratio` is the localize
stage's time over the lower stage's, measured in the same job; `budget` the jobs whose search
stopped at validate.localize_seconds (set it with --budget; null: none).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from tabulate import tabulate

# The planted rewrite and the in-process job are the tests' (tests/test_localize.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter import config, export, models
from exporter.backends.common import xnnpack_rewrites
from exporter.command.schemas import register_schemas
from exporter.localize.cut import tensor_nodes
from tests.test_config import composed
from tests.test_localize import job_in_process, wrong_below_the_bound


def planted_node(model: str, folder: Path, at: str) -> str:
    """The rsqrt of the last (or first) layer's post-attention norm in the model's exported
    program."""
    job = config.to_job(composed(f"model={model}"))
    program = export.run(models.build(job.model, job.dynamic), job.export, folder)
    norms = [
        node.name
        for node in tensor_nodes(program.program)
        if node.target == torch.ops.aten.rsqrt.default
        and "post_attention_layernorm" in list(node.meta["nn_module_stack"].values())[-1][0]
    ]
    return norms[0] if at == "first" else norms[-1]


def measure(model: str, runs: int, folder: Path, at: str, budget: str) -> list[object]:
    planted = planted_node(model, folder / "program", at)
    upper = config.to_job(composed(f"model={model}")).dynamic["seq"].max
    rewrite = wrong_below_the_bound(planted, upper)
    for_xnnpack = xnnpack_rewrites.for_xnnpack
    xnnpack_rewrites.for_xnnpack = lambda program: rewrite(for_xnnpack(program))
    lower, localize, lowerings, found, stopped = [], [], [], [], []
    try:
        for run in range(runs):
            record, report = job_in_process(
                folder / f"run-{run}",
                f"model={model}",
                "backend=executorch",
                f"validate.localize_seconds={budget}",
            )
            divergence = report["first_divergence"]
            lower.append(record.seconds["lower"])
            localize.append(record.seconds["localize"])
            lowerings.append(divergence.get("lowerings"))
            found.append(divergence.get("node") == planted)
            stopped.append(bool(divergence.get("budget_hit")))
    finally:
        xnnpack_rewrites.for_xnnpack = for_xnnpack
    lower_s, localize_s = statistics.median(lower), statistics.median(localize)
    return [
        model,
        planted,
        f"{lower_s:.1f}",
        f"{localize_s:.1f}",
        f"{localize_s / lower_s:.1f}x",
        ",".join(str(n) for n in lowerings),
        "yes" if all(found) else f"{sum(found)} of {runs}",
        f"{sum(stopped)} of {runs}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="model preset (repeatable)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--at", choices=("first", "last"), default="last", help="planted layer")
    parser.add_argument("--budget", default="null", help="validate.localize_seconds")
    args = parser.parse_args()
    register_schemas()
    rows = []
    for model in args.model or ["llama", "llama_45m"]:
        with tempfile.TemporaryDirectory() as folder:
            rows.append(measure(model, args.runs, Path(folder), args.at, args.budget))
        print(f"{model}: done", flush=True)
    headers = [
        "model",
        "planted at",
        "lower s",
        "localize s",
        "ratio",
        "lowerings",
        "found",
        "budget",
    ]
    print(f"\nmedians of {args.runs} jobs, backend=executorch (XNNPACK), {args.at} layer")
    print(tabulate(rows, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
