"""Where a failed artifact first goes wrong: the first node of the exported program, in
topological order, whose value differs from eager's beyond the job's rule at the failing shape.

Backend-agnostic: the program is cut after some of its nodes (exporter/localize/cut.py), that
prefix is lowered by the job's own backend and policy and run as validation ran the artifact (the
same executions, in the same order, up to the one that failed), and each node's value is judged
against its float64 eager value with eager's own error at the model's dtype
(exporter/localize/node_values.py). Each lowering cuts after up to `PROBES` nodes spread over the
nodes still in question, so one lowering narrows the search sixteenfold, where bisection would
halve it, and also after the node in question and the nodes up to `UPSTREAM` steps above it:
where one of those diverges too, the search goes on before it, so the node named is one that
diverges while nothing just above it does. The default Llama (150 nodes) takes four lowerings
(bench/localize.py).

First of all the whole program is lowered again: where that artifact passes at the failing shape,
the artifact judged is not what lowering makes now (tampered, stale or corrupted), and no node
is named.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.export import ExportedProgram

from exporter import interrupts
from exporter.localize.cut import cut, tensor_nodes
from exporter.localize.node_values import node_values
from exporter.quiet_logs import quieted
from runtimes import Loaded
from runtimes.verdict.compare import Tolerances, compare, reference_error
from runtimes.verdict.shapes import LiveShape, label

log = logging.getLogger(__name__)

# Nodes one lowering cuts after while the search narrows, besides the node in question and its
# inputs: 7 took the default Llama five lowerings, 15 four; a cut's extra outputs cost little.
PROBES = 15
# How far above the node in question the search looks for a node that diverges first. Its
# inputs alone can be within the rule while the node they come from is not: a norm's mean
# averages an error of 2e-5 of its input's scale down to 6e-6 of its own, under the rule's floor
# of 1e-5, and its rsqrt amplifies it again (a planted bug in the default Llama's rotary
# embedding was named at the next norm's rsqrt). Four steps reach across a norm.
UPSTREAM = 4
# What lowering says at INFO (its partition, its policy) the job's own lowering said once.
_LOWERING_LOGS = ("exporter.backends", "exporter.lowering")

Inputs = tuple[torch.Tensor, ...]
# Lowers a program into the folder and returns a loader of the artifact.
Lower = Callable[[ExportedProgram, Path], Callable[[], Loaded]]


@dataclass(frozen=True)
class Replay:
    """Validation's executions up to and including the one to search at: (inputs, whether it
    ran on a freshly loaded instance), its shape, and whether its outputs diverged there
    (validate.localize=always searches a passing job too, at its worst execution)."""

    executions: tuple[tuple[Inputs, bool], ...]
    shape: LiveShape
    diverged: bool = True


@dataclass(frozen=True)
class NodeError:
    """One node's value from the artifact against its float64 eager value; `ref_*` are eager's
    own errors at the model's dtype, which the reference rule scales."""

    node: str
    op: str
    # The artifact's value's shape and eager's: a value of another shape differs everywhere.
    shape: tuple[int, ...]
    expected_shape: tuple[int, ...]
    max_abs: float
    nrmse: float
    ref_max_abs: float
    ref_nrmse: float
    within: bool


@dataclass(frozen=True)
class FirstDivergence:
    node: str
    op: str
    # The module that called it (nn_module_stack's innermost: path and class).
    module: str
    # The model's source line that made it (`source_line`).
    source: str
    shape: LiveShape
    error: NodeError
    # The nodes feeding it and their errors (all within), and the weights it reads.
    inputs: tuple[NodeError, ...]
    weights: tuple[str, ...]
    lowerings: int
    seconds: float

    def to_json(self) -> dict:
        return {"reproduced": True, **asdict(self)}

    def summary(self) -> str:
        return f"{self.node} ({self.op})"

    def lines(self) -> list[str]:
        feeding = ", ".join(
            f"{e.node} (max_abs {e.max_abs:.3g}, eager {e.ref_max_abs:.3g})" for e in self.inputs
        )
        return [
            f"first divergence at {label(self.shape)}: node {self.node} ({self.op})",
            f"  module: {self.module or '(the model itself)'}",
            f"  source: {self.source or '(no stack trace recorded)'}",
            (
                f"  its shape: {self.error.shape} where eager's is {self.error.expected_shape}"
                if self.error.shape != self.error.expected_shape
                else f"  its error: max_abs {self.error.max_abs:.3g}, nrmse "
                f"{self.error.nrmse:.3g} (eager at the model's dtype: "
                f"{self.error.ref_max_abs:.3g}, {self.error.ref_nrmse:.3g})"
            ),
            f"  fed by: {feeding or 'the inputs only'}"
            + (f"; weights {', '.join(self.weights)}" if self.weights else ""),
            f"  found with {self.lowerings} lowerings in {self.seconds:.1f} s",
        ]


@dataclass(frozen=True)
class NotReproduced:
    shape: LiveShape
    reason: str
    lowerings: int
    seconds: float

    def to_json(self) -> dict:
        return {"reproduced": False, **asdict(self)}

    def summary(self) -> str:
        return "not reproduced"

    def lines(self) -> list[str]:
        return [f"first divergence: not reproduced at {label(self.shape)}: {self.reason}"]


@dataclass(frozen=True)
class NotLocalized:
    """Why no search ran, or why it stopped."""

    reason: str

    def to_json(self) -> dict:
        return {"reproduced": None, "reason": self.reason}

    def summary(self) -> str:
        return "not localized"

    def lines(self) -> list[str]:
        return [f"first divergence: not localized: {self.reason}"]


Localization = FirstDivergence | NotReproduced | NotLocalized


def localize(
    program: ExportedProgram,
    lower: Lower,
    replay: Replay,
    fails: Callable[[Sequence[torch.Tensor]], bool],
    tolerances: Tolerances,
    work_dir: Path,
) -> Localization:
    """`fails(outputs)`: whether the whole program's outputs at the replay's shape fail the
    job's rule."""
    search = _Search(program, lower, replay, tolerances, work_dir)
    if not fails(search.run(program, "the whole program")):
        if not replay.diverged:
            return NotLocalized(
                f"validation passed; at its worst execution, at {label(replay.shape)}, the "
                "program lowered again passes too: no output diverges beyond the rule"
            )
        return NotReproduced(
            replay.shape,
            "the exported program lowered again passes here, so the artifact judged is not what "
            "lowering makes now: it was changed after lowering (tampered or corrupted), or made "
            "by other code or libraries (stale). The weights audit says which weights differ.",
            search.lowerings,
            search.seconds(),
        )
    return search.first_divergence()


class _Search:
    def __init__(
        self,
        program: ExportedProgram,
        lower: Lower,
        replay: Replay,
        tolerances: Tolerances,
        work_dir: Path,
    ) -> None:
        self.program = program
        self.lower = lower
        self.replay = replay
        self.tolerances = tolerances
        self.work_dir = work_dir
        self.nodes = tensor_nodes(program)
        self.index = {node.name: i for i, node in enumerate(self.nodes)}
        self.lowerings = 0
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def run(self, program: ExportedProgram, what: str) -> tuple[torch.Tensor, ...]:
        """Lowers `program` and runs the replay on it; the last execution's outputs."""
        interrupts.check()
        self.lowerings += 1
        folder = self.work_dir / f"{self.lowerings:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            with quieted(_LOWERING_LOGS, logging.WARNING):
                load = self.lower(program, folder)
            outputs = _replayed(load, self.replay)
        finally:
            # A 1B model's part is gigabytes; the next lowering writes its own.
            shutil.rmtree(folder, ignore_errors=True)
        log.info(
            "[localize] lowering %d (%s) and %d executions: %.1f s",
            self.lowerings,
            what,
            len(self.replay.executions),
            time.perf_counter() - start,
        )
        return outputs

    def errors(self, names: Sequence[str]) -> list[NodeError] | None:
        """The errors of the nodes `names` from one lowering cut after them; None where that
        cut cannot be lowered or run."""
        what = (
            ", ".join(names)
            if len(names) <= 3
            else f"{len(names)} nodes, {names[0]} to {names[-1]}"
        )
        try:
            actual = self.run(cut(self.program, names), f"cut after {what}")
        except Exception as error:
            log.info("[localize] a cut after %s fails: %s: %s", names, type(error).__name__, error)
            return None
        inputs = self.replay.executions[-1][0]
        expected = node_values(self.program, inputs, names)
        return [
            self._judged(name, value, *expected[name])
            for name, value in zip(names, actual, strict=True)
        ]

    def _judged(
        self, name: str, actual: torch.Tensor, wide: torch.Tensor, narrow: torch.Tensor
    ) -> NodeError:
        rule = self.tolerances
        reference = reference_error(narrow, wide)
        stats = compare(
            name,
            actual,
            wide,
            narrow.dtype,
            rule.atol,
            rule.rtol,
            reference,
            rule.factor if rule.scaled else None,
            rule.floor,
        )
        node = self.nodes[self.index[name]]
        return NodeError(
            name,
            _op(node),
            stats.shape,
            stats.golden_shape,
            stats.max_abs,
            stats.nrmse,
            reference.max_abs,
            reference.nrmse,
            stats.within,
        )

    def first_divergence(self) -> Localization:
        # Known: the nodes up to `low` are within (-1: none is known), the node at `high` is not.
        low, high = -1, self._failing_output()
        known: dict[int, NodeError] = {}
        while True:
            between = range(low + 1, high)
            count = min(PROBES, len(between))
            picks = [between[(k * len(between)) // count] for k in range(count)]
            # The node in question and what lies upstream of it ride along: once nothing is
            # left between, this lowering has said whether the nodes it comes from are within.
            upstream = self._upstream(high)
            judged = self.judged(sorted({*picks, high, *upstream}))
            if not judged:
                return NotLocalized(
                    f"no cut between {self._name(low)} and {self.nodes[high].name} could be "
                    f"lowered and run; the divergence is at or before {self.nodes[high].name}"
                )
            known |= judged
            probed = [i for i in picks if i in judged]
            diverged = [i for i in probed if not judged[i].within]
            if diverged:
                high = diverged[0]
                low = max([i for i in probed if i < high], default=low)
                continue
            # A node no cut could end at is passed over, as if within.
            low = max(picks, default=low)
            if high - low > 1:
                continue
            diverged_upstream = [i for i in upstream if i in judged and not judged[i].within]
            if not diverged_upstream:
                inputs = [judged[i] for i in self._feeding(high) if i in judged]
                return self._found(self.nodes[high], judged.get(high), inputs)
            # A node that diverges upstream comes first; search before the earliest, above the
            # last node known to be within.
            high = min(diverged_upstream)
            low = max((i for i, e in known.items() if i < high and e.within), default=-1)

    def judged(self, indices: Sequence[int]) -> dict[int, NodeError]:
        """The errors of the nodes at `indices`, from one lowering cut after all of them, or
        where that cut cannot be lowered and run, one cut per node; a node no cut can end at
        is left out."""
        names = [self.nodes[i].name for i in indices]
        errors = self.errors(names)
        if errors is None and len(names) > 1:
            errors = [e for name in names for e in self.errors([name]) or ()]
        return {self.index[e.node]: e for e in errors or ()}

    def _feeding(self, index: int) -> list[int]:
        return sorted(
            self.index[n.name] for n in self.nodes[index].all_input_nodes if n.name in self.index
        )

    def _upstream(self, index: int) -> list[int]:
        """The nodes up to UPSTREAM steps above the node at `index`."""
        found: set[int] = set()
        frontier = [index]
        for _ in range(UPSTREAM):
            frontier = [i for node in frontier for i in self._feeding(node) if i not in found]
            found.update(frontier)
        return sorted(found)

    def _failing_output(self) -> int:
        """The last of the program's output nodes: every node the outputs depend on comes
        before it."""
        outputs = self.program.graph.output_node().all_input_nodes
        return max(self.index[node.name] for node in outputs if node.name in self.index)

    def _name(self, index: int) -> str:
        return "the inputs" if index < 0 else self.nodes[index].name

    def _found(
        self,
        node: torch.fx.Node,
        own: NodeError | None,
        inputs: Sequence[NodeError] = (),
    ) -> FirstDivergence:
        weights = tuple(
            _weight_name(self.program, n.name)
            for n in node.all_input_nodes
            if n.op == "placeholder" and _weight_name(self.program, n.name)
        )
        nan = math.nan
        error = own or NodeError(node.name, _op(node), (), (), nan, nan, nan, nan, False)
        return FirstDivergence(
            node=node.name,
            op=_op(node),
            module=_module(node),
            source=source_line(node),
            shape=self.replay.shape,
            error=error,
            inputs=tuple(inputs),
            weights=weights,
            lowerings=self.lowerings,
            seconds=self.seconds(),
        )


def _replayed(load: Callable[[], Loaded], replay: Replay) -> tuple[torch.Tensor, ...]:
    """The outputs of the replay's last execution, its executions run as validation ran them."""
    instance = load()
    outputs: tuple[torch.Tensor, ...] = ()
    for inputs, fresh in replay.executions:
        if fresh:
            del instance
            instance = load()
        outputs = tuple(instance.run(inputs))
    return outputs


def _op(node: torch.fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    module = getattr(node.target, "namespace", None)
    return f"{module}.{name}" if module else name


def _module(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, kind = list(stack.values())[-1]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    kind_name = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
    return f"{path} ({kind_name})" if path else kind_name


# A frame of a stack trace as Python formats it.
_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n\s*(?P<code>.*)'
)


# torch's own code: a frame in it is where torch implements the op (nn.Linear's forward), not
# where the model calls it.
_TORCH_DIR = str(Path(torch.__file__).parent) + os.sep


def source_line(node: torch.fx.Node) -> str:
    """The innermost frame of the node's stack trace outside torch's own code (the model's,
    transformers' for its models): `file:line in function: code`."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    outside = [frame for frame in frames if not frame["file"].startswith(_TORCH_DIR)]
    if not (outside or frames):
        return ""
    frame = (outside or frames)[-1]
    return f"{frame['file']}:{frame['line']} in {frame['function']}: {frame['code'].strip()}"


def _weight_name(program: ExportedProgram, placeholder: str) -> str:
    for spec in program.graph_signature.input_specs:
        if getattr(spec.arg, "name", None) == placeholder and spec.target:
            return spec.target
    return ""
