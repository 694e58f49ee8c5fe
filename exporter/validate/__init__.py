"""The validation stage: run the artifact at every planned live shape against a float64 oracle.

One loaded instance runs the shapes from max down to min and back up to max, so state kept
from a larger shape cannot hide a bug at a smaller one; a freshly loaded instance then runs
min, which catches what only a first execution at a small shape gets wrong.
"""

from __future__ import annotations

import copy
import logging
import time
import zlib
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from exporter.config import ValidateConfig
from exporter.errors import RuntimeFailed
from exporter.models import ModelBundle
from exporter.validate.compare import compare
from exporter.validate.plan import LiveShape, label, plan, run_order
from exporter.validate.report import Execution, Report
from runtimes import Loaded

log = logging.getLogger(__name__)

__all__ = ["Report", "run"]


def run(
    bundle: ModelBundle,
    load: Callable[[], Loaded],
    cfg: ValidateConfig,
    atol: float,
    rtol: float,
) -> Report:
    shapes = plan(bundle.dims, cfg.extra_shapes, cfg.random_shapes, cfg.seed)
    order = [(shape, "reused") for shape in run_order(shapes)] + [(shapes[0], "fresh")]
    log.info(
        "[validate] %d live shapes (%s), %d executions, atol=%g rtol=%g",
        len(shapes),
        ", ".join(label(s) for s in shapes),
        len(order),
        atol,
        rtol,
    )
    golden = _Oracle(bundle, cfg.seed)
    instance = load()
    executions = []
    for number, (shape, kind) in enumerate(order, start=1):
        if kind == "fresh":
            instance = load()
        inputs, goldens = golden.at(shape)
        start = time.perf_counter()
        try:
            outputs = instance.run(inputs)
        except Exception as error:
            raise RuntimeFailed(
                f"the artifact failed at {label(shape)}: {type(error).__name__}: {error}"
            ) from error
        latency_ms = (time.perf_counter() - start) * 1e3
        if len(outputs) != len(goldens):
            raise RuntimeFailed(
                f"the artifact returned {len(outputs)} outputs at {label(shape)}; "
                f"the model returns {len(goldens)} ({', '.join(bundle.output_names)})."
            )
        stats = tuple(
            compare(name, actual, expected, atol, rtol)
            for name, actual, expected in zip(bundle.output_names, outputs, goldens, strict=True)
        )
        execution = Execution(shape, kind, latency_ms, stats)
        executions.append(execution)
        log.info(
            "[validate] %2d/%d %-12s %-6s max_abs %.3g  %.3f ms  %s",
            number,
            len(order),
            label(shape),
            kind,
            max(s.max_abs for s in stats),
            latency_ms,
            "ok" if execution.passed else "FAIL",
        )
    return Report(atol, rtol, bundle.output_names, tuple(shapes), tuple(executions))


class _Oracle:
    """Inputs per live shape, drawn the way the model sees them, and eager float64 outputs."""

    def __init__(self, bundle: ModelBundle, seed: int) -> None:
        self._bundle = bundle
        self._seed = seed
        self._module = copy.deepcopy(bundle.module).to(torch.float64)
        self._cache: dict[str, tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = {}

    def at(self, shape: LiveShape) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        key = label(shape)
        if key not in self._cache:
            # Seeded by the shape itself, so adding a shape to the plan changes no other's inputs.
            inputs = self._bundle.make_inputs(shape, zlib.crc32(f"{self._seed}:{key}".encode()))
            wide = [t.to(torch.float64) if t.is_floating_point() else t for t in inputs]
            with torch.no_grad():
                goldens = pytree.tree_leaves(self._module(*wide))
            self._cache[key] = (inputs, goldens)
        return self._cache[key]
