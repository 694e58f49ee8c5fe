"""The verdict on an artifact at every planned live shape: run in the plan's order
(runtimes/verdict/shapes.py) on instances loaded as it says, each execution's outputs judged
against the goldens under the job's rule (runtimes/verdict/compare.py). A model with a KV cache
runs its sessions instead (runtimes/verdict/sessions.py), judged by `judge` too."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from runtimes import Loaded
from runtimes.verdict.compare import compare
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.goldens import Goldens
from runtimes.verdict.report import Execution, Report
from runtimes.verdict.shapes import NEW_INSTANCE, LiveShape, label
from runtimes.verdict.stats import OutputStats, Tolerances


def run(
    output_names: Sequence[str],
    load: Callable[[], Loaded],
    shapes: Sequence[LiveShape],
    executions: Sequence[tuple[LiveShape, str]],
    goldens: Goldens,
    tolerances: Tolerances,
    after_each: Callable[[int, Execution], None] = lambda number, execution: None,
    observe: Callable[[str, Sequence[torch.Tensor]], None] = lambda key, outputs: None,
) -> Report:
    """Runs `executions`, the plan's `shapes` in the order runtimes/verdict/shapes.py gives
    them, on instances that `load` makes, judging each as it ends; `after_each(number,
    execution)` is called after each, from 1, and `observe(label, outputs)` is handed the
    artifact's outputs (the job measures a quantized artifact's quality on them)."""
    instance = load()
    done = []
    for number, (shape, kind) in enumerate(executions, start=1):
        if kind == NEW_INSTANCE:
            # The one that ran the shapes before goes first: a 1B model's artifact is not loaded
            # twice.
            del instance
            instance = load()
        inputs = goldens.cases[label(shape)][0]
        start = time.perf_counter()
        try:
            outputs = instance.run(inputs)
        except Exception as error:
            raise ArtifactFailed(
                f"the artifact failed at {label(shape)}: {type(error).__name__}: {error}"
            ) from error
        wall_ms = (time.perf_counter() - start) * 1e3
        stats = judge(output_names, outputs, shape, goldens, tolerances)
        observe(label(shape), outputs)
        done.append(Execution(shape, kind, wall_ms, stats))
        after_each(number, done[-1])
    target = getattr(instance, "target", {})
    return Report(tolerances, tuple(output_names), tuple(shapes), tuple(done), target)


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
        raise ArtifactFailed(
            f"the artifact returned {len(outputs)} outputs at {label(shape)}; "
            f"the model returns {len(expected_outputs)} ({', '.join(output_names)})."
        )
    return tuple(
        compare(name, actual, expected, dtype, tolerances, reference, goldens.is_logits(index))
        for index, (name, actual, expected, dtype, reference) in enumerate(
            zip(
                output_names,
                outputs,
                expected_outputs,
                goldens.output_dtypes,
                goldens.reference[label(shape)],
                strict=True,
            )
        )
    )
