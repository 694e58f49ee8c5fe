"""The weights audit: every constant an artifact carries that came from a model parameter,
checked against that parameter (exactly, or through a stated cast or permutation).

Each backend declares which reader of `READERS` reads its artifact (its `AUDIT`, carried by the
artifact):

- pte (executorch, webgpu): the program's constants, its named data and a .ptd beside it
  (exporter/audit/executorch_files.py), and Vulkan payloads' own constants; XNNPACK's and
  Vulkan's constants are keyed by the SHA-256 of their bytes.
- aoti_package (.pt2 package): the pickled weights by name (exporter/audit/aoti_package.py).
- exported_program (torch.export .pt2): the program's state dict and constants by name.
- tensorrt_engine: nothing; every parameter is reported unseen with why (`TENSORRT_UNSEEN`).

A parameter the audit cannot find is unseen, with why, and does not fail the audit; a
parameter whose constant differs does (exporter/audit/matching.py says how they are tied).
Constants are compared on the host, wherever the artifact or the model ran.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from exporter.audit.matching import Constant, audit_constants, forms, sha256
from exporter.audit.result import Checked, Corrupted, Mismatch, Unseen, WeightsAudit

if TYPE_CHECKING:
    from exporter.backends.common.artifact import Artifact

__all__ = ["READERS", "Checked", "Corrupted", "Mismatch", "Unseen", "WeightsAudit", "audit"]

TENSORRT_UNSEEN = (
    "TensorRT engines hold their weights in TensorRT's serialized form, which only TensorRT "
    "reads, and it cannot be installed here: an engine built refittable "
    "(backend.settings.immutable_weights=false) would list its weights by name to "
    "tensorrt.Refitter, mapped to the program's parameters by torch-tensorrt's weight name map; "
    "this audit does not read engines"
)
_NOT_HELD = (
    "no constant of the artifact holds it, as is, cast or permuted (the lowering folded it "
    "into another constant, or the program does not use it)"
)


def audit(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    """Checks the constants of `artifact` against `weights`, the model's parameters and buffers
    by fully qualified name."""
    read = READERS[artifact.audit]
    # The host's copies: a program exported on the GPU holds its weights there.
    tensors = {name: w.detach().cpu() for name, w in weights.items() if isinstance(w, torch.Tensor)}
    runtime = str(artifact.runtime)
    try:
        result = read(artifact, tensors)
    except (OSError, ValueError, IndexError, KeyError, struct.error, zipfile.BadZipFile) as error:
        # The runtime, loading the same file, fails the job with its own error; the audit
        # says what it could not read.
        result = _nothing_read(runtime, tensors, f"the artifact could not be read: {error}")
    # A program's constants may hold script objects (TorchBind): no bytes to compare.
    objects = tuple(
        Unseen(name, f"a {type(w).__name__}, not a tensor: nothing to compare")
        for name, w in weights.items()
        if name not in tensors
    )
    return replace(result, unseen=result.unseen + objects) if objects else result


def _nothing_read(runtime: str, weights: Mapping[str, torch.Tensor], why: str) -> WeightsAudit:
    return WeightsAudit(
        runtime=runtime,
        read="nothing",
        checked=(),
        mismatched=(),
        unseen=tuple(Unseen(name, why) for name in weights),
    )


def _pte(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    from exporter.audit.executorch_files import program_constants

    runtime, data_path = str(artifact.runtime), artifact.data_path

    constants = list(program_constants(artifact.path, data_path))
    has_data = data_path is not None and data_path.exists()
    outside: set[str] = set()
    if not has_data:
        from runtimes.loaders.executorch import data_outside

        outside = set(data_outside(artifact.path))

    data_file = data_path.name if data_path is not None else "a data file"

    def why_unseen(name: str) -> str:
        parameter = weights[name]
        # Held outside by name (a program constant), or by key (a delegate's), the key being
        # the hash of one of the parameter's forms.
        if name in outside or any(
            sha256(form.apply(parameter)) in outside
            for form in forms(parameter)
            if outside and form.permutation != (1, 0)
        ):
            return f"the program holds it outside {artifact.path.name}, in {data_file}, not there"
        return _NOT_HELD

    keyed = sum(c.key is not None for c in constants)
    named = sum(c.name is not None for c in constants)
    delegate = "Vulkan" if runtime == "webgpu" else "XNNPACK"
    read = (
        f"{len(constants) - keyed - named} unnamed constants of the program and its payloads, "
        f"{keyed} of {delegate}'s named data keyed by the SHA-256 of their bytes, {named} by "
        "name" + (f" in {data_path.name}" if data_path is not None and has_data else "")
    )
    return _audited(runtime, read, constants, weights, why_unseen)


def _aoti_package(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    from exporter.audit.aoti_package import package_weights, why_unseen

    constants, declared, pickled = package_weights(artifact.path)
    read = (
        f"{len(constants)} pickled package weights by name; {len(declared)} constants the "
        "compiled code declares"
    )
    return _audited(
        "aoti",
        read,
        constants,
        weights,
        lambda name: why_unseen(weights[name], name, declared, pickled),
    )


def _exported_program(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    program = torch.export.load(artifact.path)
    held = {**program.state_dict, **program.constants}
    constants = [
        Constant(
            where=f"{artifact.path.name} {name!r}",
            data=memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()),
            dtype=t.dtype,
            shape=tuple(t.shape),
            name=name,
        )
        for name, t in held.items()
        if isinstance(t, torch.Tensor)
    ]
    read = f"{len(constants)} state dict entries and constants of the exported program by name"
    return _audited(str(artifact.runtime), read, constants, weights, lambda _name: _NOT_HELD)


def _audited(
    runtime: str,
    read: str,
    constants: list[Constant],
    weights: Mapping[str, torch.Tensor],
    why_unseen: Callable[[str], str],
) -> WeightsAudit:
    checked, mismatched, unseen, corrupted = audit_constants(constants, weights, why_unseen)
    return WeightsAudit(
        runtime=runtime,
        read=read,
        checked=tuple(checked),
        mismatched=tuple(mismatched),
        unseen=tuple(unseen),
        corrupted=tuple(corrupted),
    )


def _tensorrt_engine(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    return _nothing_read(str(artifact.runtime), weights, TENSORRT_UNSEEN)


# Each artifact format's reader, by the name a backend's AUDIT gives.
READERS: dict[str, Callable[[Artifact, Mapping[str, torch.Tensor]], WeightsAudit]] = {
    "pte": _pte,
    "aoti_package": _aoti_package,
    "exported_program": _exported_program,
    "tensorrt_engine": _tensorrt_engine,
}
