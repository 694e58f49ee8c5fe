"""The validation stage: run the artifact at every planned live shape against a float64 oracle.

One loaded instance runs the shapes from max down to min and back up to max, so state kept
from a larger shape cannot hide a bug at a smaller one; a freshly loaded instance then runs
min, which catches what only a first execution at a small shape gets wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from exporter import interrupts, memory
from exporter.errors import RuntimeFailed
from exporter.validate.compare import OutputStats, Tolerances, compare
from exporter.validate.goldens import Goldens
from exporter.validate.plan import LiveShape, label, run_order
from exporter.validate.report import Execution, Report
from runtimes import Loaded

log = logging.getLogger(__name__)

__all__ = ["Report", "Tolerances", "judge", "run"]


def run(
    output_names: Sequence[str],
    load: Callable[[], Loaded],
    shapes: Sequence[LiveShape],
    goldens: Goldens,
    tolerances: Tolerances,
) -> Report:
    order = [(shape, "reused") for shape in run_order(shapes)] + [(shapes[0], "fresh")]
    log.info(
        "[validate] %d live shapes (%s), %d executions, %s",
        len(shapes),
        ", ".join(label(s) for s in shapes),
        len(order),
        tolerances.describe(),
    )
    instance = load()
    executions = []
    # The bar shows on a terminal only (disable=None); the log lines say the same everywhere.
    bar = tqdm(total=len(order), desc="validate", unit="run", disable=None)
    with logging_redirect_tqdm(), bar:
        for number, (shape, kind) in enumerate(order, start=1):
            interrupts.check()
            if kind == "fresh":
                # The reused instance goes first: a 1B model's artifact is not loaded twice.
                del instance
                memory.release_freed()
                instance = load()
            execution = _execute(output_names, instance, shape, kind, goldens, tolerances)
            executions.append(execution)
            log.info(
                "[validate] %2d/%d %-12s %-6s max_abs %.3g (eager %.3g)  %.3f ms  %s",
                number,
                len(order),
                label(shape),
                kind,
                max(s.max_abs for s in execution.outputs),
                max(s.ref_max_abs for s in execution.outputs),
                execution.wall_ms,
                "ok" if execution.passed else "FAIL",
            )
            bar.update()
    target = getattr(instance, "target", {})
    return Report(tolerances, tuple(output_names), tuple(shapes), tuple(executions), target)


def _execute(
    output_names: Sequence[str],
    instance: Loaded,
    shape: LiveShape,
    kind: str,
    goldens: Goldens,
    tolerances: Tolerances,
) -> Execution:
    inputs = goldens.cases[label(shape)][0]
    start = time.perf_counter()
    try:
        outputs = instance.run(inputs)
    except Exception as error:
        raise RuntimeFailed(
            f"the artifact failed at {label(shape)}: {type(error).__name__}: {error}"
        ) from error
    wall_ms = (time.perf_counter() - start) * 1e3
    return Execution(shape, kind, wall_ms, judge(output_names, outputs, shape, goldens, tolerances))


def judge(
    output_names: Sequence[str],
    outputs: Sequence[torch.Tensor],
    shape: LiveShape,
    goldens: Goldens,
    tolerances: Tolerances,
) -> tuple[OutputStats, ...]:
    """The statistics of an artifact's outputs at `shape` against its goldens, under the rule."""
    expected_outputs = goldens.cases[label(shape)][1]
    if len(outputs) != len(expected_outputs):
        raise RuntimeFailed(
            f"the artifact returned {len(outputs)} outputs at {label(shape)}; "
            f"the model returns {len(expected_outputs)} ({', '.join(output_names)})."
        )
    return tuple(
        compare(
            name,
            actual,
            expected,
            dtype,
            tolerances.atol,
            tolerances.rtol,
            reference,
            tolerances.factor if tolerances.scaled else None,
            tolerances.floor,
        )
        for name, actual, expected, dtype, reference in zip(
            output_names,
            outputs,
            expected_outputs,
            goldens.output_dtypes,
            goldens.reference[label(shape)],
            strict=True,
        )
    )
