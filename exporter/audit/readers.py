"""The readers of the weights audit, one per artifact format: each returns the constants it
found in an artifact, audited against the model's weights. A backend's declaration names the
one that reads its artifact by its `WeightsReader` (exporter/artifact/), which `READERS` maps to
its function here.

Each format's code is imported inside its reader: a job loads only what reads its artifact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from exporter.artifact import WeightsReader
from exporter.audit.result import Unseen, WeightsAudit

if TYPE_CHECKING:
    import torch

    from exporter.artifact import Artifact
    from exporter.audit.matching import Constant

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


def nothing_read(runtime: str, weights: Mapping[str, torch.Tensor], why: str) -> WeightsAudit:
    """Every weight unseen, for `why`."""
    return WeightsAudit(
        runtime=runtime,
        read="nothing",
        checked=(),
        mismatched=(),
        unseen=tuple(Unseen(name, why) for name in weights),
    )


def pte(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    """A .pte's constants, its named data and a .ptd beside it, and Vulkan payloads' own."""
    from exporter.audit.executorch_files import program_constants
    from exporter.audit.matching import forms, sha256

    runtime, data_path = str(artifact.runtime), artifact.data_path

    constants = list(program_constants(artifact.path, data_path))
    has_data = data_path is not None and data_path.exists()
    outside: set[str] = set()
    if not has_data:
        from runtimes.loaders.executorch import data_outside

        outside = set(data_outside(artifact.path))

    data_file = data_path.name if data_path is not None else "a data file"

    def why_unseen(name: str, parameter: torch.Tensor) -> str:
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
    # XNNPACK's quantized weights hold no zero point; what Vulkan's would is not read here.
    no_zero_points = delegate if delegate == "XNNPACK" else None
    return _audited(runtime, read, constants, weights, why_unseen, no_zero_points)


def aoti_package(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    """An AOTInductor package's pickled weights, by name."""
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
        lambda name, parameter: why_unseen(parameter, name, declared, pickled),
    )


def exported_program(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    """A torch.export program's state dict and constants, by name (a quantized weight, which
    the program keeps as torchao's tensor, as its parts); those of every program of the file
    (a decoder's encode method beside the model)."""
    import torch
    from torch.export.pt2_archive._package import load_pt2

    from exporter.audit.matching import Constant
    from exporter.audit.quantized import unpacked

    held, _parts = unpacked(
        {
            name: tensor
            for program in load_pt2(artifact.path).exported_programs.values()
            for name, tensor in {**program.state_dict, **program.constants}.items()
        }
    )
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
    read = f"{len(constants)} state dict entries and constants of the exported programs by name"
    return _audited(
        str(artifact.runtime), read, constants, weights, lambda _name, _parameter: _NOT_HELD
    )


def _audited(
    runtime: str,
    read: str,
    constants: list[Constant],
    weights: Mapping[str, torch.Tensor],
    why_unseen: Callable[[str, torch.Tensor], str],
    no_zero_points: str | None = None,
) -> WeightsAudit:
    from exporter.audit.matching import audit_constants
    from exporter.audit.quantized import summary

    found = audit_constants(constants, weights, why_unseen, no_zero_points)
    return WeightsAudit(
        runtime=runtime,
        read=read,
        checked=tuple(found.checked),
        mismatched=tuple(found.mismatched),
        unseen=tuple(found.unseen),
        corrupted=tuple(found.corrupted),
        quantized=summary(found.parts, found.checked),
    )


def tensorrt_engine(artifact: Artifact, weights: Mapping[str, torch.Tensor]) -> WeightsAudit:
    """Nothing: TensorRT's engines are read by TensorRT alone (`TENSORRT_UNSEEN`)."""
    return nothing_read(str(artifact.runtime), weights, TENSORRT_UNSEEN)


# Each WeightsReader's function: the reader a backend declares, by its name.
READERS: dict[WeightsReader, Callable[[Artifact, Mapping[str, torch.Tensor]], WeightsAudit]] = {
    WeightsReader.pte: pte,
    WeightsReader.aoti_package: aoti_package,
    WeightsReader.exported_program: exported_program,
    WeightsReader.tensorrt_engine: tensorrt_engine,
}
