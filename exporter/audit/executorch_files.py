"""The constants an ExecuTorch program carries, read from its .pte (and .ptd) without copying
them: the files are mapped, and each constant is a view of the mapping.

- The program's own constants (those no delegate took): TensorValues with a data buffer, in the
  constant segment (unnamed), or with external weights in the .ptd under their fully qualified
  names.
- Named data, in the .pte or the .ptd: XNNPACK and Vulkan store each constant they serialize
  under the SHA-256 (hex) of its bytes (XNNPACK a quantized weight's scales under "scale_" and
  that); a .ptd also holds the program's constants by name.
- A Vulkan (WebGPU) delegate's payload: constants in its own bytes, with their dtype and dims.

Field indices follow executorch's exir/_serialize/program.fbs ("ET12"),
extension/flat_tensor/serialize/flat_tensor.fbs ("FT01") and, for Vulkan payloads,
runtimes/formats/vulkan_payload.py.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from flatbuffers import number_types as N

from exporter.audit.matching import Constant
from runtimes.formats.flatbuffer_table import Table
from runtimes.formats.pte_file import SCALAR_TYPES
from runtimes.formats.vulkan_payload import NAMED_DATA_OFFSET, VkTensor, read_vulkan_payload

_PROGRAM_ID, _FLAT_TENSOR_ID = b"ET12", b"FT01"
_PROGRAM_HEADER, _FLAT_TENSOR_HEADER = b"eh00", b"FH01"
_TENSOR = 5  # KernelTypes union member
_EXTERNAL = 1  # TensorDataLocation
_SEGMENT = 1  # DataLocation
_VULKAN = "VulkanBackend"
# XNNPACK keys a quantized weight's scales by "scale_" and the SHA-256 of their bytes.
_SHA256_KEY = re.compile(r"(?:scale_)?([0-9a-f]{64})")
_VULKAN_DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
}


def mapped(path: Path) -> memoryview:
    """The file, mapped read-only; the mapping lives as long as a view of it does."""
    with path.open("rb") as file:
        return memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))


def program_constants(pte: Path, ptd: Path | None) -> Iterator[Constant]:
    """Every constant of the program, its named data and delegates, and of `ptd` where it
    exists."""
    data = mapped(pte)
    program_size, segment_base = _program_header(data)
    program = Table.root(bytes(data[:program_size]), _PROGRAM_ID)
    segments = [
        (int(s.scalar(0, N.Uint64Flags)), int(s.scalar(1, N.Uint64Flags)))
        for s in program.tables(4)
    ]

    def segment(index: int) -> memoryview:
        offset, size = segments[index]
        return data[segment_base + offset : segment_base + offset + size]

    named = {n.string(0) or "": segment(int(n.scalar(1, N.Uint32Flags))) for n in program.tables(7)}
    yield from _named_data(named, f"{pte.name} named data")
    if ptd is not None and ptd.exists():
        yield from _flat_tensor(ptd)
    buffer = _ConstantBuffer(program, segment)
    inline_delegate_data = [d.blob(0) for d in program.tables(3)]
    for plan in program.tables(1):
        for index, wrapper in enumerate(plan.tables(2)):
            kind, tensor = wrapper.union(0)
            if kind == _TENSOR and tensor is not None:
                found = _tensor_constant(tensor, index, buffer, pte.name)
                if found is not None:
                    yield found
        for delegate in plan.tables(7):
            if delegate.string(0) != _VULKAN:
                continue
            processed = delegate.table(1)
            if processed is None:
                continue
            index = int(processed.scalar(1, N.Uint32Flags))
            payload = (
                segment(index)
                if processed.scalar(0, N.Int8Flags) == _SEGMENT
                else memoryview(inline_delegate_data[index])
            )
            yield from _vulkan_constants(payload)


def _program_header(data: memoryview) -> tuple[int, int]:
    """The program flatbuffer's size and the segments' base ("eh00" after the first 8 bytes;
    without it the whole file is the flatbuffer)."""
    if bytes(data[8:12]) != _PROGRAM_HEADER:
        return len(data), 0
    _length, program_size, segment_base = struct.unpack_from("<IQQ", data, 12)
    return program_size, segment_base


class _ConstantBuffer:
    """Where the program's constants lie: the constant segment at offsets, or the legacy
    inline buffers."""

    def __init__(self, program: Table, segment: Callable[[int], memoryview]) -> None:
        self.buffers = [b.blob(0) for b in program.tables(2)]
        self.data: memoryview | None = None
        self.offsets: list[int] = []
        table = program.table(5)
        if table is not None:
            self.offsets = [int(o) for o in table.vector(1, N.Uint64Flags)]
            if len(self.offsets) > 1:  # offsets[0] is reserved for non-constant tensors
                self.data = segment(int(table.scalar(0, N.Uint32Flags)))

    def get(self, index: int, nbytes: int) -> memoryview | bytes:
        if self.buffers:
            return self.buffers[index][:nbytes]
        if self.data is None:
            raise ValueError(f"constant {index} is used, but the program has no constant segment")
        return self.data[self.offsets[index] : self.offsets[index] + nbytes]


def _tensor_constant(
    tensor: Table, index: int, buffer: _ConstantBuffer, file: str
) -> Constant | None:
    """A constant TensorValue held in the .pte, or None (planned, an input, or held outside:
    an external one is in the .ptd under its name, read there)."""
    extra = tensor.table(9)
    buffer_index = int(tensor.scalar(5, N.Uint32Flags))
    if buffer_index == 0 or (extra is not None and extra.scalar(2, N.Int8Flags) == _EXTERNAL):
        return None
    if tensor.table(6) is not None:  # a mutable buffer's initial state, not a weight
        return None
    dtype = SCALAR_TYPES[int(tensor.scalar(0, N.Int8Flags))]
    shape = tuple(int(d) for d in tensor.vector(2, N.Int32Flags))
    return Constant(
        where=f"{file} program constant (value {index})",
        data=buffer.get(buffer_index, math.prod(shape) * dtype.itemsize),
        dtype=dtype,
        shape=shape,
    )


def _named_data(named: dict[str, memoryview], where: str) -> Iterator[Constant]:
    for key, blob in named.items():
        keyed = _SHA256_KEY.fullmatch(key)
        yield Constant(
            where=f"{where} {key[: 12 + key.index(keyed[1])]}…" if keyed else f"{where} {key!r}",
            data=blob,
            key=keyed[1] if keyed else None,
            name=None if keyed else key,
        )


def _flat_tensor(path: Path) -> Iterator[Constant]:
    """A .ptd's entries: the program's constants by name (with dtype and sizes), and
    delegates' constants by key."""
    data = mapped(path)
    if bytes(data[8:12]) != _FLAT_TENSOR_HEADER:
        raise ValueError(f"{path}: not an ExecuTorch data file (no {_FLAT_TENSOR_HEADER!r})")
    flatbuffer_offset, flatbuffer_size, segment_base = struct.unpack_from("<QQQ", data, 16)
    root = Table.root(bytes(data[: flatbuffer_offset + flatbuffer_size]), _FLAT_TENSOR_ID)
    segments = [
        (int(s.scalar(0, N.Uint64Flags)), int(s.scalar(1, N.Uint64Flags))) for s in root.tables(1)
    ]
    for entry in root.tables(2):
        key = entry.string(0) or ""
        offset, size = segments[int(entry.scalar(1, N.Uint32Flags))]
        blob = data[segment_base + offset : segment_base + offset + size]
        layout = entry.table(2)
        if layout is None or _SHA256_KEY.fullmatch(key):
            yield from _named_data({key: blob}, f"{path.name}")
            continue
        dtype = SCALAR_TYPES[int(layout.scalar(0, N.Int8Flags))]
        shape = tuple(int(d) for d in layout.vector(1, N.Int32Flags))
        yield Constant(
            where=f"{path.name} {key!r}",
            data=blob[: math.prod(shape) * dtype.itemsize],
            dtype=dtype,
            shape=shape,
            name=key,
        )


def _vulkan_constants(payload: memoryview) -> Iterator[Constant]:
    """A Vulkan payload's constants held in its own bytes, with their dtype and dims (those in
    named data are read there, by key)."""
    graph = read_vulkan_payload(bytes(payload))
    for value in graph.values:
        if not isinstance(value, VkTensor) or value.constant_id < 0:
            continue
        constant = graph.constants[value.constant_id]
        if constant.offset == NAMED_DATA_OFFSET:
            continue
        dtype = _VULKAN_DTYPES[value.staging_dtype or value.dtype]
        yield Constant(
            where=f"Vulkan payload constant {value.constant_id}",
            data=graph.constant_bytes[constant.offset : constant.offset + constant.length],
            dtype=dtype,
            shape=value.dims,
        )
