"""Per-shape latency of a backend=webgpu program next to eager PyTorch, as a table.

    python bench/webgpu_latency.py outputs/runs/.../model.pte model=llama \\
        --device auto --torch-device cuda --repeats 20

The program runs through runtimes/webgpu on the wgpu adapter `--device` picks (auto, gpu, cpu);
eager runs the model's own module on `--torch-device`. Both see the live shapes validation
plans for the model's dims, each once to warm up, then `--repeats` times, taking turns so that
both see the same machine; the table gives medians, inputs copied in and outputs copied back
included (and the program's `execute` alone, its inputs uploaded before), and the ratio of the
two runs' medians. The model config must be the one the program was lowered from (same
overrides): its outputs are compared, as a sanity check.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from tabulate import tabulate

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

from exporter import config, models  # noqa: E402
from exporter.command import schemas  # noqa: E402
from exporter.validate.plan import plan  # noqa: E402
from runtimes import load  # noqa: E402
from runtimes.verdict.shapes import label  # noqa: E402


def elapsed_ms(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def medians_ms(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Each call's median time over `repeats` rounds, the calls taking turns in every round."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, samples in zip(calls, times, strict=True):
            samples.append(elapsed_ms(call))
    return [statistics.median(samples) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("program", type=Path)
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides of the model, e.g. model=llama"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu"])
    parser.add_argument("--torch-device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    schemas.register_schemas()
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), version_base="1.3"):
        job = config.to_job(compose("config", overrides=args.overrides))
    bundle = models.build(job.model, job.dynamic)
    module = bundle.module.to(args.torch_device)
    program = load(args.program, "webgpu", args.device)
    print(f"webgpu adapter: {program.target}; eager on {args.torch_device}")

    def eager(inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            result = module(*[t.to(args.torch_device) for t in inputs])
        logits = getattr(result, "logits", result)
        outputs = logits if isinstance(logits, tuple) else (logits,)
        return tuple(output.cpu() for output in outputs)

    rows = []
    for shape in plan(bundle.dims, job.validate.extra_shapes, job.validate.random_shapes, 0):
        inputs = bundle.make_inputs(shape, 0)
        resident = program.upload(inputs)
        gpu_ms, execute_ms, eager_ms = medians_ms(
            [
                lambda inputs=inputs: program.run(inputs),
                lambda resident=resident: program.execute(resident),
                lambda inputs=inputs: eager(inputs),
            ],
            args.repeats,
        )
        error = max(
            (got - want).abs().max().item()
            for got, want in zip(program.run(inputs), eager(inputs), strict=True)
        )
        rows.append(
            [
                label(shape),
                f"{gpu_ms:.2f}",
                f"{execute_ms:.2f}",
                f"{eager_ms:.2f}",
                f"{gpu_ms / eager_ms:.2f}",
                f"{error:.2g}",
            ]
        )
    headers = [
        "shape",
        f"webgpu ms ({program.target['adapter']})",
        "execute ms",
        f"eager ms ({args.torch_device})",
        "webgpu / eager",
        "max_abs",
    ]
    print(tabulate(rows, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
