"""The validation stage: run the artifact at every planned live shape against a float64 oracle.

One loaded instance runs the shapes from max down to min and back up to max, so state kept
from a larger shape cannot hide a bug at a smaller one; a freshly loaded instance then runs
min, which catches what only a first execution at a small shape gets wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from exporter import interrupts
from exporter.errors import RuntimeFailed
from exporter.models import ModelBundle
from exporter.validate.compare import compare
from exporter.validate.goldens import Goldens
from exporter.validate.plan import LiveShape, label, run_order
from exporter.validate.report import Execution, Report
from runtimes import Loaded

log = logging.getLogger(__name__)

__all__ = ["Report", "run"]


def run(
    bundle: ModelBundle,
    load: Callable[[], Loaded],
    shapes: Sequence[LiveShape],
    goldens: Goldens,
    atol: float,
    rtol: float,
) -> Report:
    order = [(shape, "reused") for shape in run_order(shapes)] + [(shapes[0], "fresh")]
    log.info(
        "[validate] %d live shapes (%s), %d executions, atol=%g rtol=%g",
        len(shapes),
        ", ".join(label(s) for s in shapes),
        len(order),
        atol,
        rtol,
    )
    instance = load()
    executions = []
    # The bar shows on a terminal only (disable=None); the log lines say the same everywhere.
    bar = tqdm(total=len(order), desc="validate", unit="run", disable=None)
    with logging_redirect_tqdm(), bar:
        for number, (shape, kind) in enumerate(order, start=1):
            interrupts.check()
            if kind == "fresh":
                instance = load()
            execution = _execute(bundle, instance, shape, kind, goldens, atol, rtol)
            executions.append(execution)
            log.info(
                "[validate] %2d/%d %-12s %-6s max_abs %.3g  %.3f ms  %s",
                number,
                len(order),
                label(shape),
                kind,
                max(s.max_abs for s in execution.outputs),
                execution.latency_ms,
                "ok" if execution.passed else "FAIL",
            )
            bar.update()
    target = getattr(instance, "target", {})
    return Report(atol, rtol, bundle.output_names, tuple(shapes), tuple(executions), target)


def _execute(
    bundle: ModelBundle,
    instance: Loaded,
    shape: LiveShape,
    kind: str,
    goldens: Goldens,
    atol: float,
    rtol: float,
) -> Execution:
    inputs, expected_outputs = goldens.cases[label(shape)]
    start = time.perf_counter()
    try:
        outputs = instance.run(inputs)
    except Exception as error:
        raise RuntimeFailed(
            f"the artifact failed at {label(shape)}: {type(error).__name__}: {error}"
        ) from error
    latency_ms = (time.perf_counter() - start) * 1e3
    if len(outputs) != len(expected_outputs):
        raise RuntimeFailed(
            f"the artifact returned {len(outputs)} outputs at {label(shape)}; "
            f"the model returns {len(expected_outputs)} ({', '.join(bundle.output_names)})."
        )
    stats = tuple(
        compare(name, actual, expected, dtype, atol, rtol)
        for name, actual, expected, dtype in zip(
            bundle.output_names, outputs, expected_outputs, goldens.output_dtypes, strict=True
        )
    )
    return Execution(shape, kind, latency_ms, stats)
