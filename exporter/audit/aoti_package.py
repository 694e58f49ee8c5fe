"""The weights an AOTInductor package carries. The project packages them as one pickled tensor
per weight (exporter/backends/aoti.py: data/weights/, mapped by
data/aotinductor/<model>/weights_config.json from each weight's fully qualified name to its file
and its view: shape, stride, offset; weights that share storage share a file, across models
too: a decode step's config names the model's files). The package's wrapper.cpp declares every
constant its compiled code reads (`constants_info_[i].original_fqn`). A weight that holds several
of the model's, concatenated (exporter/artifact/fused_weights.py, recorded in the models'
metadata), is read as its parts, each under its own name.
"""

from __future__ import annotations

import io
import json
import re
import struct
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from exporter.artifact import fused_weights
from exporter.artifact.fused_weights import FUSED_WEIGHTS, Fused
from exporter.audit.matching import Constant

_WEIGHTS_CONFIG = re.compile(r"(.*/)?data/aotinductor/[^/]+/weights_config\.json")
_WRAPPER = re.compile(r"(.*/)?data/aotinductor/[^/]+/[^/]+\.wrapper\.cpp")
_METADATA = re.compile(r"(.*/)?data/aotinductor/[^/]+/[^/]+_metadata\.json")
_DECLARED = re.compile(r'constants_info_\[\d+\]\.original_fqn = "([^"]*)";')
# A zip entry's local header: signature, versions, flags, method, time, date, CRC-32, sizes,
# and the lengths of the name and the extra field that follow it.
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
# Inductor writes a 1-D constant of at most this many elements into its kernels as literals
# (torch._inductor.graph.GraphLowering.can_inline_constant).
_INLINED = 8


def package_weights(path: Path) -> tuple[list[Constant], set[str], bool]:
    """The package's weights (by name), the names its compiled code declares, and whether it
    has pickled weights at all (without, they are in the .so's data section)."""
    with path.open("rb") as raw, zipfile.ZipFile(raw) as archive:
        names = archive.namelist()
        declared: set[str] = set()
        fused: dict[str, Fused] = {}
        for name in names:
            if _WRAPPER.fullmatch(name):
                declared.update(_DECLARED.findall(archive.read(name).decode()))
            if _METADATA.fullmatch(name):
                recorded = json.loads(archive.read(name)).get(FUSED_WEIGHTS)
                fused.update(fused_weights.from_json(recorded) if recorded else {})
        configs = [n for n in names if _WEIGHTS_CONFIG.fullmatch(n)]
        if not configs:
            return [], declared, False
        constants = list(_weights(archive, raw, configs, fused))
    return constants, declared, True


def _weights(
    archive: zipfile.ZipFile, raw: BinaryIO, configs: list[str], fused: Mapping[str, Fused]
) -> Iterator[Constant]:
    """Each weight once per view of a file: two models reading one weight's file as one view
    read one weight; a model with its own copy has it checked too. A fused weight is its
    parts."""
    seen: set[tuple[str, str, str]] = set()
    for config_name in configs:
        root = config_name.split("data/aotinductor/")[0]
        config: Mapping[str, list] = json.loads(archive.read(config_name))
        by_file: dict[str, list[tuple[str, list]]] = {}
        for fqn, entry in config.items():
            view = (root, fqn, json.dumps(entry))
            if view not in seen:
                seen.add(view)
                by_file.setdefault(entry[0], []).append((fqn, entry))
        for file, entries in by_file.items():
            # One file's tensor at a time, and each weight's bytes taken from it. A package
            # compiled for the GPU pickled its weights there: read them onto the host.
            stored = torch.load(
                io.BytesIO(_entry(archive, raw, f"{root}data/weights/{file}")),
                map_location="cpu",
                weights_only=True,
            )
            for fqn, (_file, shape, stride, offset) in entries:
                view = torch.as_strided(stored.detach(), shape, stride, offset)
                where = f"package weight {file}"
                if fqn in fused:
                    yield from _parts(view, fused[fqn], f"{where} (part of {fqn})")
                else:
                    yield _constant(view, where, fqn)
            del stored


def _parts(weight: torch.Tensor, fused: Fused, where: str) -> Iterator[Constant]:
    sizes = fused.split_sizes(weight.shape[fused.dim])
    for (name, _), part in zip(fused.parts, weight.split(sizes, fused.dim), strict=True):
        yield _constant(part, where, name)


def _constant(view: torch.Tensor, where: str, name: str) -> Constant:
    value = view.contiguous()
    return Constant(
        where=where,
        data=memoryview(value.reshape(-1).view(torch.uint8).numpy()),
        dtype=value.dtype,
        shape=tuple(value.shape),
        name=name,
    )


def _entry(archive: zipfile.ZipFile, raw: BinaryIO, name: str) -> bytes:
    """An entry's bytes as they lie in the archive, its CRC-32 unchecked: torch's loader does
    not check it either, so a weight changed after packaging runs, and must be compared, not
    refused. torch writes entries uncompressed (stored); another is read through zipfile."""
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        return archive.read(info)
    raw.seek(info.header_offset)
    name_length, extra_length = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))[-2:]
    raw.seek(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)
    return raw.read(info.compress_size)


def why_unseen(parameter: torch.Tensor, name: str, declared: set[str], pickled: bool) -> str:
    if not pickled:
        return (
            "the package keeps its weights in the .so's data section (no weights_config.json), "
            "which the audit does not read"
        )
    if name in declared:
        return "the compiled code reads it, but the package holds no weights file for it"
    if parameter.dim() == 1 and parameter.shape[0] <= _INLINED:
        return (
            f"a 1-D constant of at most {_INLINED} elements: Inductor writes it into its kernels "
            "as literals, not into the package's weights"
        )
    return (
        "the compiled code reads no constant of this name (the program does not use it, or "
        "Inductor folded it into another)"
    )
