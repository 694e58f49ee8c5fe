"""The export stage: torch.export with the declared dynamic dims, saved as program.pt2.

A failed export is diagnosed with draft_export (export_report.json / .txt, exit 3); with
`export.on_failure=draft` the job goes on with draft_export's program instead, and its report
stays beside the program. An export that narrows a declared dim fails either way.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.export import ExportedProgram
from torch.export.pt2_archive._package import load_pt2, package_pt2

from exporter.config import ExportConfig, ExportFailurePolicy, GuardPolicy
from exporter.errors import ExportFailed
from exporter.export import shapes
from exporter.export.diagnosis import Diagnosis, diagnose
from exporter.files import atomic_path
from exporter.models import ModelBundle, RunnerMetadata
from runtimes.int4_kernels import packing_record
from runtimes.loaders.eager import ENCODE, MODEL

log = logging.getLogger(__name__)

# The model's program, with its decoder's encode method beside it where it has one (ENCODE;
# torch.export.load reads the model's, MODEL).
PROGRAM_FILE = "program.pt2"
# Where strict export has Dynamo install what it captured (_dynamo_capture_released).
_CAPTURING_MODULE = "torch._dynamo.functional_export"

__all__ = [
    "ENCODE",
    "PROGRAM_FILE",
    "Diagnosis",
    "ExportDiagnosed",
    "Exported",
    "load",
    "profiles",
    "run",
]


class ExportDiagnosed(ExportFailed):
    """torch.export failed; `diagnosis` says where and what to do."""

    def __init__(self, diagnosis: Diagnosis) -> None:
        super().__init__(diagnosis.text())
        self.diagnosis = diagnosis


@dataclass(frozen=True)
class Exported:
    program: ExportedProgram
    path: Path
    # Each input's shapes at the bounds it was exported for: a backend's shape profiles.
    inputs: tuple[shapes.InputProfile, ...]
    # Set when torch.export failed and the job went on with draft_export's program.
    diagnosis: Diagnosis | None = None
    # What an LLM runner reads of the artifact (ModelBundle.runner_metadata): a backend whose
    # format holds such metadata writes it (ExecuTorch's .pte, as methods returning constants).
    runner_metadata: RunnerMetadata = field(default_factory=dict)
    # The decoder's encode method (Decoder.encoding) as a program of its own, its state named
    # as the program names it; None where the model has none.
    encode: ExportedProgram | None = None


def run(bundle: ModelBundle, settings: ExportConfig, out_dir: Path) -> Exported:
    example = bundle.make_inputs(bundle.max_sizes(), 0)
    bounds = ", ".join(
        f"{d.name} in [{d.min}, {d.max}] ({'static' if d.is_static else d.mode.value})"
        for d in bundle.dims
    )
    log.info("[export] torch.export of %s with %s", bundle.name, bounds)
    diagnosis = None
    said = io.StringIO()
    try:
        # On failure torch.export prints its partial graph to stderr, which the report keeps;
        # on success what it printed (warnings) goes to the job's log.
        with contextlib.redirect_stderr(said), _dynamo_capture_released():
            program = torch.export.export(
                bundle.module,
                example,
                dynamic_shapes=shapes.spec(bundle),
                strict=bundle.export_strict,
                prefer_deferred_runtime_asserts_over_guards=settings.guards is GuardPolicy.runtime,
            )
    except Exception as error:
        log.info("[export] torch.export failed; diagnosing with torch.export.draft_export")
        diagnosis, program = diagnose(bundle, example, error)
        if settings.on_failure is ExportFailurePolicy.fail or program is None:
            raise ExportDiagnosed(diagnosis) from error
        narrowing = shapes.narrowed(program, bundle)
        if narrowing:
            log.error(
                "[export] export.on_failure=draft: the draft program narrows %s",
                ", ".join(
                    f"{n.dim.name} (declared {n.dim.min}..{n.dim.max}) to {n.lower}..{n.upper}"
                    for n in narrowing
                ),
            )
            raise ExportDiagnosed(diagnosis) from error
        diagnosis.continued_with_draft = True
        log.warning("[export] %s", diagnosis.text())
        diagnosis.write(out_dir)
    else:
        if said.getvalue().strip():
            log.info("[export] torch.export wrote:\n%s", said.getvalue().rstrip())
        narrowed = shapes.narrowed(program, bundle)
        if narrowed:
            # Nothing raised, yet a dim came out narrower (an unbacked dim that a runtime
            # assert pinned): as much a failure as a constraint violation.
            error = ExportFailed("torch.export narrowed declared-dynamic dims")
            raise ExportDiagnosed(diagnose(bundle, example, error, narrowed)[0])
    encode = _export_encode(bundle)
    path = out_dir / PROGRAM_FILE
    with atomic_path(path) as temporary:
        if encode is None:
            torch.export.save(program, temporary, extra_files=packing_record(program))
        else:
            program, encode = _used_weights_only(program), _used_weights_only(encode)
            package_pt2(
                temporary,
                exported_programs={MODEL: program, ENCODE: encode},
                extra_files=packing_record(program) | packing_record(encode),
            )
    return Exported(
        program, path, shapes.profiles(bundle), diagnosis, bundle.runner_metadata(), encode
    )


def _export_encode(bundle: ModelBundle) -> ExportedProgram | None:
    """The decoder's encode method exported at its one input's shape."""
    encoding = bundle.decoder.encoding if bundle.decoder else None
    if encoding is None:
        return None
    log.info("[export] torch.export of %s's encode method", bundle.name)
    try:
        with _dynamo_capture_released():
            program = torch.export.export(
                encoding.module, (encoding.make_input(0),), strict=bundle.export_strict
            )
    except Exception as error:
        raise ExportFailed(
            f"torch.export of the encode method failed: {type(error).__name__}: {error}"
        ) from error
    return program


def _used_weights_only(program: ExportedProgram) -> ExportedProgram:
    """`program` without the state dict entries its signature does not name, in place. Strict
    export keeps the whole module's state dict beside a graph that reads part of it: a
    decoder's program would hold its encoder's weights too, the encode program the decoder's,
    and program.pt2 every weight twice."""
    named = {spec.target for spec in program.graph_signature.input_specs}
    for name in [name for name in program.state_dict if name not in named]:
        del program.state_dict[name]
    return program


@contextlib.contextmanager
def _dynamo_capture_released() -> Iterator[None]:
    """Drops what a strict export leaves behind in Dynamo's module: torch 2.14's strict export
    installs the graph Dynamo captured (a `__compiled_fn_*` global, holding the model's
    parameters) in torch._dynamo.functional_export and never removes it, so the model outlived
    the job's export stage with all its weights (a 1B model's 4.95 GB through lowering). Looked
    up by name: a torch without that module or global leaves nothing to drop."""
    before = _captured()
    try:
        yield
    finally:
        for name in _captured() - before:
            delattr(sys.modules[_CAPTURING_MODULE], name)


def _captured() -> set[str]:
    module = sys.modules.get(_CAPTURING_MODULE)
    return {n for n in vars(module) if n.startswith("__compiled_fn_")} if module else set()


def profiles(bundle: ModelBundle) -> tuple[shapes.InputProfile, ...]:
    """What `load` needs of the model besides the program: its inputs' shapes at the bounds."""
    return shapes.profiles(bundle)


def load(
    folder: Path,
    profiles: tuple[shapes.InputProfile, ...],
    runner_metadata: RunnerMetadata | None = None,
) -> Exported:
    """The program that `run` saved into `folder` (or a copy of it), as `run` returned it for
    the bundle `profiles` and `runner_metadata` came from."""
    path = folder / PROGRAM_FILE
    programs = load_pt2(path).exported_programs
    program, encode = programs[MODEL], programs.get(ENCODE)
    return Exported(
        program, path, profiles, Diagnosis.read(folder), dict(runner_metadata or {}), encode
    )
