"""Where a failed artifact first goes wrong: the first node of the exported program, in
topological order, whose value differs from eager's beyond the job's rule at the failing shape.

Backend-agnostic: the program is cut after some of its nodes (exporter/localize/cut.py), that
prefix is lowered by the job's own backend and policy and run as validation ran the artifact (the
same executions, in the same order, up to the one that failed), and each node's value is judged
against its float64 eager value with eager's own error at the model's dtype
(exporter/localize/node_values.py).

A lowering costs what its prefix costs: a cut near the front lowers in a fraction of the whole
program's time, a cut near the end costs a full lowering. So the search goes front first: while
no cut has diverged, each lowering cuts after `PROBES` nodes spread over a stretch of the
program past the last node known within, the first stretch reaching a sixteenth of its nodes and
each next one reaching `GROWTH` times further. A lowering bug shows first where its pattern
first occurs, in the first layers, and is then found with cuts of a small part of the program;
a divergence in the last layer costs two short lowerings (a sixteenth and a quarter of the
program) more than a search that spread its first cut over the whole program (bench/localize.py
measures both). Once a node diverges,
each lowering cuts after `PROBES` nodes spread over those between the last node known within and
it, narrowing the search sixteenfold, and once `PROBES` nodes or fewer are left, one lowering
cuts after all of them, the node known to diverge, and the nodes up to `UPSTREAM` steps above
each: where one of those diverges too, the search goes on before it, so the node named is one
that diverges while nothing just above it does.

A model with a KV cache fails at a step of a session: the replay is every call that validation
made on its one instance up to that step, so that each lowered part's cache buffers hold what
the artifact's held there, and eager's node values come from the program run through the same
calls, its buffers carried from each to the next (exporter/localize/node_values.py).

Before searching, the whole program is lowered again to see whether the artifact judged is what
lowering makes now: where that artifact passes at the failing shape, it is not (tampered, stale
or corrupted), and no node is named. That lowering is skipped, and the result says why, where
the caller knows the artifact is what lowering makes now (the job lowered it in this run, or
took it from the cache, keyed by the program, code and libraries and checked by its checksums);
a given artifact, or a passing job searched with validate.localize=always, keeps it.

The search stops before a lowering that would take it past its budget (validate.localize_seconds),
each lowering's time estimated from those before it (a known full lowering, then each cut's by
its length), and says what it narrowed the divergence down to.
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

from exporter.localize.cut import cut, tensor_nodes
from exporter.localize.node_values import Buffers, node_values
from exporter.process import interrupts
from exporter.process.quiet_logs import quieted
from runtimes import Loaded
from runtimes.verdict.compare import compare, reference_error
from runtimes.verdict.shapes import LiveShape, label
from runtimes.verdict.stats import Tolerances

log = logging.getLogger(__name__)

# Nodes one lowering cuts after while the search narrows: 7 took the default Llama five lowerings,
# 15 four; a cut's extra outputs cost little.
PROBES = 15
# The front-first stretches: the first reaches this share of the program's nodes, each next one
# GROWTH times further (a sixteenth, a quarter, all of it).
FIRST_REACH = 1 / 16
GROWTH = 4
# How far above the node in question the search looks for a node that diverges first. Its
# inputs alone can be within the rule while the node they come from is not: a norm's mean
# averages an error of 2e-5 of its input's scale down to 6e-6 of its own, under the rule's floor
# of 1e-5, and its rsqrt amplifies it again (a planted bug in the default Llama's rotary
# embedding was named at the next norm's rsqrt). Four steps reach across a norm.
UPSTREAM = 4
# What lowering says at INFO (its partition, its policy) the job's own lowering said once.
_LOWERING_LOGS = ("exporter.backends",)

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

    def calls_before(self) -> tuple[Inputs, ...]:
        """The calls the last execution's instance took before it: what a program with state
        (a KV cache) had written into its buffers when it ran the last."""
        fresh = [i for i, (_, new) in enumerate(self.executions) if new]
        first = fresh[-1] if fresh else 0
        return tuple(inputs for inputs, _ in self.executions[first:-1])


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
    # Whether the whole program was lowered again before the search, or why not.
    relowering: str

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
            f"  found with {self.lowerings} lowerings in {self.seconds:.1f} s; {self.relowering}",
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


@dataclass(frozen=True)
class Narrowed:
    """The search stopped at its budget (validate.localize_seconds): the first divergence is
    after the node `after` (the last known within; "" for the program's inputs) and at or
    before `up_to` (the first known to diverge, or the failing output), `nodes` nodes in all."""

    shape: LiveShape
    after: str
    after_module: str
    up_to: str
    up_to_module: str
    nodes: int
    lowerings: int
    seconds: float
    budget_seconds: float
    # What the lowering the search stopped before was estimated to take.
    next_lowering_seconds: float
    relowering: str

    def to_json(self) -> dict:
        return {"reproduced": None, "budget_hit": True, **asdict(self)}

    def summary(self) -> str:
        after = self.after or "the inputs"
        return f"budget hit: {self.nodes} nodes after {after} up to {self.up_to}"

    def lines(self) -> list[str]:
        after = (
            f"{self.after} in {self.after_module or 'the model'}" if self.after else "the inputs"
        )
        return [
            f"first divergence: not localized within validate.localize_seconds="
            f"{self.budget_seconds:g}: the next lowering would take about "
            f"{self.next_lowering_seconds:.0f} s after {self.seconds:.0f} s spent",
            f"  narrowed at {label(self.shape)} to {self.nodes} nodes: after {after} "
            f"up to {self.up_to} in {self.up_to_module or 'the model'}",
            f"  {self.lowerings} lowerings in {self.seconds:.1f} s; {self.relowering}",
        ]


Localization = FirstDivergence | NotReproduced | NotLocalized | Narrowed


def localize(
    program: ExportedProgram,
    lower: Lower,
    replay: Replay,
    fails: Callable[[Sequence[torch.Tensor]], bool],
    tolerances: Tolerances,
    work_dir: Path,
    *,
    lowered_now: str = "",
    budget_seconds: float | None = None,
    full_lowering_seconds: float | None = None,
    started: float | None = None,
) -> Localization:
    """`fails(outputs)`: whether the whole program's outputs at the replay's shape fail the
    job's rule. `lowered_now`: why the artifact judged is known to be what lowering makes now
    (""; unknown: the whole program is lowered again first). `budget_seconds`: the search stops
    before a lowering that would take it past this many seconds since `started` (a
    `time.perf_counter()`, by default now; None: no limit). `full_lowering_seconds`: what
    lowering the whole program took, where the job measured it: the first estimate."""
    search = _Search(program, lower, replay, tolerances, work_dir, budget_seconds, started)
    if full_lowering_seconds is not None:
        search.costs[len(search.nodes)] = full_lowering_seconds
    try:
        if lowered_now and replay.diverged:
            search.relowering = f"the whole program was not lowered again: {lowered_now}"
            return search.first_divergence()
        if not fails(search.run(program, "the whole program", len(search.nodes))):
            if not replay.diverged:
                return NotLocalized(
                    f"validation passed; at its worst execution, at {label(replay.shape)}, the "
                    "program lowered again passes too: no output diverges beyond the rule"
                )
            return NotReproduced(
                replay.shape,
                "the exported program lowered again passes here, so the artifact judged is not "
                "what lowering makes now: it was changed after lowering (tampered or corrupted), "
                "or made by other code or libraries (stale). The weights audit says which "
                "weights differ.",
                search.lowerings,
                search.seconds(),
            )
        search.relowering = "the whole program lowered again fails here too"
        return search.first_divergence()
    except _OverBudget as over:
        return search.narrowed(over.estimate)


class _OverBudget(Exception):
    def __init__(self, estimate: float) -> None:
        super().__init__(f"the next lowering would take about {estimate:.0f} s")
        self.estimate = estimate


class _Search:
    def __init__(
        self,
        program: ExportedProgram,
        lower: Lower,
        replay: Replay,
        tolerances: Tolerances,
        work_dir: Path,
        budget_seconds: float | None,
        started: float | None,
    ) -> None:
        self.program = program
        self.lower = lower
        self.replay = replay
        self.tolerances = tolerances
        self.work_dir = work_dir
        self.budget_seconds = budget_seconds
        self.nodes = tensor_nodes(program)
        self.index = {node.name: i for i, node in enumerate(self.nodes)}
        self.lowerings = 0
        self.started = time.perf_counter() if started is None else started
        # What one lowering and its run took, by the number of nodes up to its last cut.
        self.costs: dict[int, float] = {}
        self.relowering = ""
        # Known: the nodes up to `low` are within (-1: none is known), the node at `high` is not.
        self.low, self.high = -1, self._failing_output()
        # Eager's buffers as the calls before the last left them (a KV cache), once needed.
        self._buffers: Buffers | None = None

    def buffers(self) -> Buffers:
        if self._buffers is None:
            self._buffers = Buffers.after(self.program, self.replay.calls_before())
        return self._buffers

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def run(self, program: ExportedProgram, what: str, length: int) -> tuple[torch.Tensor, ...]:
        """Lowers `program`, `length` nodes of the whole one, and runs the replay on it; the
        last execution's outputs."""
        interrupts.check()
        estimate = self.estimate(length)
        if (
            self.budget_seconds is not None
            and estimate is not None
            and self.seconds() + estimate > self.budget_seconds
        ):
            raise _OverBudget(estimate)
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
            self.costs[length] = time.perf_counter() - start
        log.info(
            "[localize] lowering %d (%s) and %d executions: %.1f s",
            self.lowerings,
            what,
            len(self.replay.executions),
            self.costs[length],
        )
        return outputs

    def estimate(self, length: int) -> float | None:
        """What lowering and running a program of `length` nodes is expected to take: between
        two lengths measured, the straight line between them; below the shortest, the
        shortest's time (a shorter cut costs no more); beyond the longest, the longest's time
        scaled by length (more than it will take where each lowering has a fixed cost too).
        None before anything was measured."""
        shorter = [n for n in self.costs if n <= length]
        longer = [n for n in self.costs if n >= length]
        if shorter and longer:
            below, above = max(shorter), min(longer)
            if below == above:
                return self.costs[below]
            slope = (self.costs[above] - self.costs[below]) / (above - below)
            return self.costs[below] + slope * (length - below)
        if longer:
            return self.costs[min(longer)]
        if shorter:
            return self.costs[max(shorter)] * length / max(shorter)
        return None

    def errors(self, names: Sequence[str]) -> list[NodeError] | None:
        """The errors of the nodes `names` from one lowering cut after them; None where that
        cut cannot be lowered or run."""
        what = (
            ", ".join(names)
            if len(names) <= 3
            else f"{len(names)} nodes, {names[0]} to {names[-1]}"
        )
        length = 1 + max(self.index[name] for name in names)
        start = time.perf_counter()
        try:
            actual = self.run(cut(self.program, names), f"cut after {what}", length)
        except _OverBudget:
            raise
        except Exception as error:
            log.info("[localize] a cut after %s fails: %s: %s", names, type(error).__name__, error)
            return None
        inputs = self.replay.executions[-1][0]
        expected = node_values(self.program, inputs, names, self.buffers())
        # The next estimate's: eager's values are part of what a cut costs.
        self.costs[length] = time.perf_counter() - start
        return [
            self._judged(name, value, *expected[name])
            for name, value in zip(names, actual, strict=True)
        ]

    def _judged(
        self, name: str, actual: torch.Tensor, wide: torch.Tensor, narrow: torch.Tensor
    ) -> NodeError:
        reference = reference_error(narrow, wide)
        stats = compare(name, actual, wide, narrow.dtype, self.tolerances, reference)
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
        known: dict[int, NodeError] = {}
        # Front first until a cut diverges: how far the next stretch reaches, in nodes.
        reach: float | None = FIRST_REACH * (self.high + 1)
        while True:
            between = range(self.low + 1, self.high)
            if len(between) <= PROBES:
                # One lowering says it all: every node left, the node known to diverge, and
                # what lies upstream of each.
                candidates = [*between, self.high]
                upstream = {i for c in candidates for i in self._upstream(c)}
                judged = self.judged(sorted({*candidates, *upstream}))
                if not judged:
                    return self._uncut()
                known |= judged
                diverged = [i for i in candidates if i in judged and not judged[i].within]
                if not diverged and self.high in judged:
                    return self._not_reproduced_in_parts()
                # Where no cut can end at the node known to diverge, it is named as it is.
                first = diverged[0] if diverged else self.high
                diverged_upstream = [
                    i for i in self._upstream(first) if i in known and not known[i].within
                ]
                if not diverged_upstream:
                    inputs = [known[i] for i in self._feeding(first) if i in known]
                    return self._found(self.nodes[first], known.get(first), inputs)
                # A node that diverges upstream comes first; search before the earliest, above
                # the last node known to be within.
                self.high = min(diverged_upstream)
                self.low = max(
                    (i for i, e in known.items() if i < self.high and e.within), default=-1
                )
                reach = None
                continue
            if reach is None:
                # Sixteen equal pieces: the last cut leaves a sixteenth before `high`.
                picks = [
                    between[((k + 1) * len(between)) // (PROBES + 1) - 1] for k in range(PROBES)
                ]
            else:
                stretch = range(self.low + 1, min(max(math.ceil(reach), self.low + 2), self.high))
                count = min(PROBES, len(stretch))
                picks = [stretch[((k + 1) * len(stretch)) // count - 1] for k in range(count)]
                reach *= GROWTH
            judged = self.judged(picks)
            if not judged:
                return self._uncut()
            known |= judged
            diverged = [i for i in picks if i in judged and not judged[i].within]
            if diverged:
                self.high = diverged[0]
                self.low = max((i for i in judged if i < self.high), default=self.low)
                reach = None
            else:
                # A node no cut could end at is passed over, as if within.
                self.low = max(picks)

    def _uncut(self) -> NotLocalized:
        high = self.nodes[self.high].name
        return NotLocalized(
            f"no cut between {self._name(self.low)} and {high} could be lowered and run; the "
            f"divergence is at or before {high}"
        )

    def _not_reproduced_in_parts(self) -> NotReproduced:
        return NotReproduced(
            self.replay.shape,
            f"cut after its nodes and lowered now, the program diverges nowhere up to "
            f"{self.nodes[self.high].name}, where the artifact judged (or an earlier cut) "
            "diverged: lowering it again does not make the same artifact (not deterministic), "
            "or the output that failed is not the program's last",
            self.lowerings,
            self.seconds(),
        )

    def narrowed(self, estimate: float) -> Narrowed:
        assert self.budget_seconds is not None
        after = self.nodes[self.low] if self.low >= 0 else None
        return Narrowed(
            shape=self.replay.shape,
            after=after.name if after else "",
            after_module=_module(after) if after else "",
            up_to=self.nodes[self.high].name,
            up_to_module=_module(self.nodes[self.high]),
            nodes=self.high - self.low,
            lowerings=self.lowerings,
            seconds=self.seconds(),
            budget_seconds=self.budget_seconds,
            next_lowering_seconds=estimate,
            relowering=self.relowering or "the whole program was to be lowered again first",
        )

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
            relowering=self.relowering,
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
