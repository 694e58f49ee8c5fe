"""Why torch.export failed, in a few lines a user can act on.

torch.export stops at the first problem. `torch.export.draft_export` traces the same model on
the same inputs with real tensors beside the fake ones, goes past each problem, and reports all
of them with the user's stack; this module turns that report, and torch.export's own error,
into a Diagnosis: per failure its kind, the model line, and the fix.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
import sysconfig
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.exc import UserError, UserErrorType
from torch.export import ExportedProgram
from torch.export._draft_export import FailureType
from torch.fx.experimental import sym_node
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from exporter.config import DimMode
from exporter.export import shapes
from exporter.export.shapes import Narrowing
from exporter.files import write_bytes, write_json
from exporter.models import ModelBundle
from exporter.process.quiet_logs import quieted

REPORT_JSON = "export_report.json"
REPORT_TEXT = "export_report.txt"

DATA_DEPENDENT = "data-dependent error"
GUARD_ADDED = "guard added"
SPECIALIZED = "specialized dim"
MISSING_FAKE_KERNEL = "missing fake kernel"
MISMATCHED_FAKE_KERNEL = "mismatched fake kernel"
OTHER = "export error"


# draft_export warns at length about tlparse and each guard; our diagnosis says it once.
_TORCH_LOGS = ("torch.export._draft_export", "torch.fx.experimental.symbolic_shapes")

_DATA_DEPENDENT_FIX = (
    "branch on data with torch.cond(pred, true_fn, false_fn, operands) or torch.where so both "
    "sides are traced; if the condition holds for every input, assert it before the line with "
    "torch._check(<condition>) (torch._check(n >= 0) for a size)."
)
# Frames from these are torch's or Python's, or this stage calling torch.export.
_NOT_USER_CODE = (
    str(Path(torch.__file__).parent),
    sysconfig.get_paths()["stdlib"],
    str(Path(__file__).parent),
)
# "L['x'].size()[0]": the input a symbol came from, and the axis.
_SOURCE = re.compile(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]")


@dataclass(frozen=True)
class Location:
    file: str
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.code}"


@dataclass(frozen=True)
class Failure:
    kind: str
    what: str
    fix: str
    location: Location | None = None
    dims: tuple[str, ...] = ()


@dataclass
class Diagnosis:
    """torch.export's error, the failures found, and whether the job went on with the draft."""

    error: str
    failures: list[Failure]
    draft_export: str
    continued_with_draft: bool = False
    # torch's name for an input axis ("x[0]") -> our dim: how to read `error`'s sources.
    dims: dict[str, str] = field(default_factory=dict)
    # The graph torch.export traced up to the failure.
    partial_graph: str = ""

    @property
    def kinds(self) -> list[str]:
        return sorted({failure.kind for failure in self.failures})

    def text(self) -> str:
        lines = [f"torch.export failed: {len(self.failures)} problem(s) found."]
        for number, failure in enumerate(self.failures, 1):
            lines.append(f"{number}. [{failure.kind}] {failure.what}")
            if failure.location:
                lines.append(f"   at {failure.location}")
            lines.append(f"   fix: {failure.fix}")
        lines.append(f"({self.draft_export})")
        if self.continued_with_draft:
            lines.append(
                "export.on_failure=draft: the job goes on with draft_export's program, which "
                "holds only for inputs that take the same branches as the example."
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kinds": self.kinds}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> Diagnosis:
        failures = [
            Failure(
                **{
                    **failure,
                    "location": Location(**failure["location"]) if failure["location"] else None,
                    "dims": tuple(failure["dims"]),
                }
            )
            for failure in payload["failures"]
        ]
        return cls(
            error=payload["error"],
            failures=failures,
            draft_export=payload["draft_export"],
            continued_with_draft=payload["continued_with_draft"],
            dims=payload["dims"],
            partial_graph=payload["partial_graph"],
        )

    def write(self, folder: Path) -> None:
        write_json(folder / REPORT_JSON, self.to_json())
        write_bytes(folder / REPORT_TEXT, (self.text() + "\n").encode())

    @classmethod
    def read(cls, folder: Path) -> Diagnosis | None:
        path = folder / REPORT_JSON
        return cls.from_json(json.loads(path.read_text())) if path.exists() else None


def diagnose(
    bundle: ModelBundle,
    example: tuple[torch.Tensor, ...],
    error: Exception,
    narrowed: Sequence[Narrowing] = (),
) -> tuple[Diagnosis, ExportedProgram | None]:
    """The diagnosis of `error`, and draft_export's program where it made one.

    `narrowed`: dims that an export which did not raise still narrowed (shapes.narrowed)."""
    dims = _dim_names(bundle)
    specialized = [_specialization(n) for n in [*_specialized(error, bundle), *narrowed]]
    program = None
    found: list[Failure] = []
    try:
        # draft_export takes no ShapesSpec (torch 2.14): unbacked dims are diagnosed as backed.
        with quieted(_TORCH_LOGS, logging.ERROR), _no_expression_records():
            program = torch.export.draft_export(
                bundle.module,
                example,
                dynamic_shapes=shapes.spec(bundle, DimMode.backed),
                strict=False,
            )
        report = program._report
        found = [_failure(failure.failure_type, failure.data, dims) for failure in report.failures]
        ran = f"draft_export found {len(report.failures)} issue(s)"
    except Exception as draft_error:
        ran = f"draft_export failed too: {type(draft_error).__name__}: {_first_line(draft_error)}"
    backed_exports = program is not None and not found
    failures = _with_guard_lines(specialized, found) or [_from_error(error, bundle, backed_exports)]
    failures = _with_torch_checks(failures, str(error))
    diagnosis = Diagnosis(
        error=f"{type(error).__name__}: {error}",
        failures=failures,
        draft_export=ran,
        dims={f"{name}[{axis}]": dim for (name, axis), dim in dims.items()},
        # The graph traced up to the failure, which torch.export prints to stderr.
        partial_graph=str(getattr(error, "partial_fx_graph", "") or ""),
    )
    return diagnosis, program


# The one event of torch's symbolic nodes: each expression they create, with its stacks.
_EXPRESSION_CREATED = "expression_created"


@contextmanager
def _no_expression_records() -> Iterator[None]:
    """draft_export records every symbolic expression that torch creates, with the Python stacks
    it was created under, for tlparse's view of where a failing expression came from. The
    diagnosis reads only the failures, and the stacks were most of draft_export's time: for the
    tiny ConvNeXt in bfloat16 of tests/test_hf_image.py, about 24,000 expressions, its failed
    export took 47 s with them and 10 s without on a 2-core machine. Inside, torch's symbolic
    nodes record nothing; the guards, data-dependent values and fake kernels that make the
    failures are recorded as before."""
    record = sym_node.dtrace_structured

    def unless_an_expression(name: str, *args: Any, **kwargs: Any) -> None:
        if name != _EXPRESSION_CREATED:
            record(name, *args, **kwargs)

    sym_node.dtrace_structured = unless_an_expression
    try:
        yield
    finally:
        sym_node.dtrace_structured = record


def _dim_names(bundle: ModelBundle) -> dict[tuple[str, int], str]:
    """(forward's parameter name, axis) -> our dim name: torch names sources by parameter."""
    parameters = list(inspect.signature(bundle.module.forward).parameters)
    position = {name: index for index, name in enumerate(bundle.input_names)}
    return {
        (parameters[position[input_name]], axis): dim.name
        for dim in bundle.dims
        for input_name, axis in dim.axes
    }


def _specialized(error: Exception, bundle: ModelBundle) -> list[Narrowing]:
    """The dims torch.export's constraint violation names, with the bounds it suggests."""
    violated = UserErrorType.CONSTRAINT_VIOLATION
    if not (isinstance(error, UserError) and error.error_type is violated):
        return []
    _, _, suggested = str(error).partition("Suggested fixes:")
    narrowings = []
    for dim in bundle.dims:
        match = re.search(rf"^\s*{dim.name} = (.+)$", suggested, re.MULTILINE)
        if match is None:
            continue
        value = match.group(1).strip()
        if value.isdigit():
            narrowings.append(Narrowing(dim, int(value), int(value)))
            continue
        low = re.search(r"min=(\d+)", value)
        high = re.search(r"max=(\d+)", value)
        lower = int(low.group(1)) if low else dim.min
        upper = int(high.group(1)) if high else dim.max
        narrowings.append(Narrowing(dim, lower, upper))
    return narrowings


def _specialization(narrowing: Narrowing) -> Failure:
    dim, lower, upper = narrowing.dim, narrowing.lower, narrowing.upper
    declared = f"declared {dim.min}..{dim.max}"
    if lower == upper:
        what = f"{dim.name} ({declared}) was specialized to the constant {lower}"
        fix = (
            f"make that line work for every {dim.name} (it ties the size to {lower}), or "
            f"if the model only takes {lower}, set dynamic.{dim.name}.min={lower} "
            f"dynamic.{dim.name}.max={lower}"
        )
    else:
        what = f"{dim.name} ({declared}) was narrowed to {lower}..{upper}"
        fix = (
            f"make that line work for every {dim.name}, or bound it as the model allows: "
            f"dynamic.{dim.name}.min={lower} dynamic.{dim.name}.max={upper}"
        )
    return Failure(SPECIALIZED, what, fix, dims=(dim.name,))


def _with_guard_lines(specialized: list[Failure], found: list[Failure]) -> list[Failure]:
    """Each specialized dim takes the line of draft_export's first guard on it; those guards
    are then told once, as the specialization, not twice."""
    located = []
    used: set[int] = set()
    for failure in specialized:
        for index, guard in enumerate(found):
            if guard.kind == GUARD_ADDED and set(failure.dims) & set(guard.dims):
                failure = dataclasses.replace(failure, location=guard.location)
                used.add(index)
                break
        located.append(failure)
    return located + [failure for index, failure in enumerate(found) if index not in used]


def _with_torch_checks(failures: list[Failure], message: str) -> list[Failure]:
    """torch.export sometimes spells out the torch._check calls that would fix its
    data-dependent error; the first such failure gets them as its fix."""
    checks = re.findall(r"^\s+\d+\. (torch\._check\(.*\))$", message, re.MULTILINE)
    for index, failure in enumerate(failures):
        if checks and failure.kind == DATA_DEPENDENT:
            fix = f"insert one of these before the line: {' or '.join(checks)}; {failure.fix}"
            failures[index] = dataclasses.replace(failure, fix=fix)
            break
    return failures


def _from_error(error: Exception, bundle: ModelBundle, backed_exports: bool) -> Failure:
    """torch.export's error alone, where draft_export found nothing to add; `backed_exports`:
    draft_export, which traces every dim backed, ran clean."""
    location = _user_frame(error)
    if not isinstance(error, GuardOnDataDependentSymNode):
        return Failure(
            OTHER,
            f"{type(error).__name__}: {_first_line(error)}",
            "see the message and the line above; the full traceback is in traceback.txt.",
            location,
        )
    fix = _DATA_DEPENDENT_FIX
    unbacked = [d.name for d in bundle.dims if d.mode is DimMode.unbacked and not d.is_static]
    if unbacked and backed_exports:
        names = ", ".join(unbacked)
        fix = (
            f"the model branches on the size of {names}, which is unbacked here; traced backed, "
            f"it exports: set dynamic.{unbacked[0]}.mode=backed. Or {fix}"
        )
    return Failure(
        DATA_DEPENDENT,
        f"the value of `{error.cond}` is unknown while tracing, so the branch cannot be decided",
        fix,
        location,
    )


def _failure(kind: FailureType, data: dict[str, Any], dims: dict[tuple[str, int], str]) -> Failure:
    location = _stack_location(data.get("user_stack") or [])
    if kind is FailureType.DATA_DEPENDENT_ERROR:
        return Failure(
            DATA_DEPENDENT,
            f"the value of `{data['expr']}` depends on tensor data, so tracing cannot decide it "
            f"(draft_export took {data.get('result')} from the example)",
            _DATA_DEPENDENT_FIX,
            location,
        )
    if kind is FailureType.GUARD_ADDED:
        guarded = sorted(
            {
                dims.get((match.group(1), int(match.group(2))), source)
                for source in data.get("symbol_to_sources", {}).values()
                for match in [_SOURCE.search(str(source))]
                if match
            }
        )
        return Failure(
            GUARD_ADDED,
            f"the guard `{data['expr']}` was added on {', '.join(guarded) or 'a size'}",
            "make the line hold for every size in the declared bounds, or narrow the bounds "
            "(dynamic.<dim>.min/max) to where it holds; where it holds for every size and "
            "export cannot prove it, export.guards=runtime checks it when the program runs.",
            location,
            tuple(guarded),
        )
    op = data.get("op", "?")
    if kind is FailureType.MISSING_FAKE_KERNEL:
        return Failure(
            MISSING_FAKE_KERNEL,
            f"torch.ops.{op} has no fake (meta) kernel, so export cannot trace its shapes",
            f"register one with @torch.library.register_fake('{op}').",
            location,
        )
    return Failure(
        MISMATCHED_FAKE_KERNEL,
        f"torch.ops.{op}'s fake kernel disagrees with the real one: {data.get('reason')}",
        f"fix the function registered with torch.library.register_fake('{op}').",
        location,
    )


def _stack_location(stack: list[dict[str, Any]]) -> Location | None:
    """The innermost frame of the user's code: torch logs file names as interned numbers."""
    names = {number: name for name, number in torch._logging.structured.INTERN_TABLE.items()}
    for frame in reversed(stack):
        filename = names.get(frame.get("filename"))
        if filename and not filename.startswith(_NOT_USER_CODE):
            return Location(filename, int(frame["line"]), str(frame.get("loc", "")).strip())
    return None


def _user_frame(error: Exception) -> Location | None:
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not frame.filename.startswith(_NOT_USER_CODE):
            return Location(frame.filename, frame.lineno or 0, (frame.line or "").strip())
    return None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
