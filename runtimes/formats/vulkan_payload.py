"""Read a VulkanBackend delegate payload without executorch.

executorch's own reader goes through flatc's JSON, which cannot hold -inf or nan (attention masks
have them); reading the binary directly has no such gap. The layout follows executorch's
`backends/vulkan/serialization/vulkan_graph_serialize.py` (header "VH00") and `schema.fbs`
(file identifier "VK00"); field indices below are the fields' positions in that schema's tables.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from flatbuffers import number_types as N

from runtimes.formats.flatbuffer_table import Table

_HEADER_MAGIC = b"VH00"
_HEADER_LENGTH = 30
_IDENTIFIER = b"VK00"

# VkDataType values; 127 (UNSET) is absent.
_DTYPES = {
    0: "bool",
    1: "uint8",
    2: "int8",
    3: "int32",
    4: "float16",
    5: "float32",
    6: "float64",
    7: "int64",
}
_UNSET_DTYPE = 127
_STORAGE_TYPES = {0: "BUFFER", 1: "TEXTURE_3D", 2: "TEXTURE_2D"}
_MEMORY_LAYOUTS = {
    0: "TENSOR_WIDTH_PACKED",
    1: "TENSOR_HEIGHT_PACKED",
    2: "TENSOR_CHANNELS_PACKED",
    3: "PACKED_INT8_4W4C",
    4: "PACKED_INT8_4H4W",
    5: "PACKED_INT8_4W",
    6: "PACKED_INT8_4C",
    8: "PACKED_INT8_4C1W",
    9: "PACKED_INT8_CONV2D",
}
_DEFAULT = 255  # VkStorageType / VkMemoryLayout: let the runtime choose
# GraphTypes union members, in schema order from 1 (0 is "NONE").
_VALUE_KINDS = (
    "NONE",
    "Null",
    "Int",
    "Double",
    "Bool",
    "VkTensor",
    "IntList",
    "DoubleList",
    "BoolList",
    "ValueList",
    "String",
    "SymInt",
)
# A constant whose data is in the program's named data rather than in the payload.
NAMED_DATA_OFFSET = 2**64 - 1


@dataclass(frozen=True)
class VkTensor:
    dtype: str  # one of "bool", "uint8", "int8", "int32", "float16", "float32", "float64", "int64"
    dims: tuple[int, ...]
    constant_id: int  # index into VkGraph.constants; negative when not a constant
    mem_obj_id: int  # tensors with the same non-negative id share memory
    staging_dtype: str | None  # dtype of the data outside the GPU, when it differs from dtype
    storage_type: str | None  # e.g. "BUFFER"; None lets the runtime choose
    memory_layout: str | None  # e.g. "TENSOR_WIDTH_PACKED"; None lets the runtime choose


@dataclass(frozen=True)
class IntList:
    """Literal ints (unlike a .pte's IntList, which holds value indices)."""

    items: tuple[int, ...]


@dataclass(frozen=True)
class DoubleList:
    items: tuple[float, ...]


@dataclass(frozen=True)
class BoolList:
    items: tuple[bool, ...]


@dataclass(frozen=True)
class ValueList:
    value_ids: tuple[int, ...]


@dataclass(frozen=True)
class SymInt:
    """An int the graph updates at run time (e.g. a tensor's dynamic size); `value` is its start."""

    value: int


VkValue = (
    None
    | int
    | float
    | bool
    | str
    | VkTensor
    | IntList
    | DoubleList
    | BoolList
    | ValueList
    | SymInt
)


@dataclass(frozen=True)
class OperatorCall:
    node_id: int
    name: str  # e.g. "aten.linear.default"
    args: tuple[int, ...]  # value ids, outputs included


@dataclass(frozen=True)
class Constant:
    """A region of VkGraph.constant_bytes, or (offset NAMED_DATA_OFFSET) a program's named data."""

    offset: int
    length: int
    named_key: str | None


@dataclass(frozen=True)
class VkGraph:
    version: str
    chain: tuple[OperatorCall, ...]
    values: tuple[VkValue, ...]
    input_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    constants: tuple[Constant, ...]
    constant_bytes: bytes
    storage_type_override: str | None
    memory_layout_override: str | None


def read_vulkan_payload(payload: bytes) -> VkGraph:
    """Reads one delegate payload; a malformed one raises ValueError saying what is wrong."""
    try:
        return _read(bytes(payload))
    except (ValueError, IndexError, struct.error) as e:
        raise ValueError(f"Vulkan delegate payload: {e}") from e


def _read(payload: bytes) -> VkGraph:
    if len(payload) < _HEADER_LENGTH:
        raise ValueError(f"{len(payload)} bytes is too short for the {_HEADER_LENGTH}-byte header")
    if payload[4:8] != _HEADER_MAGIC:
        raise ValueError(f"header magic is {payload[4:8]!r}, expected {_HEADER_MAGIC!r}")
    length, fb_offset, fb_size, bytes_offset, bytes_size = struct.unpack_from("<HIIIQ", payload, 8)
    if length != _HEADER_LENGTH:
        raise ValueError(f"header length is {length}, expected {_HEADER_LENGTH}")
    for what, end in (("flatbuffer", fb_offset + fb_size), ("bytes", bytes_offset + bytes_size)):
        if end > len(payload):
            raise ValueError(f"{what} region ends at {end}, past the {len(payload)} bytes given")
    graph = Table.root(payload[fb_offset : fb_offset + fb_size], _IDENTIFIER)
    if graph.tables(6):
        raise ValueError("custom shaders are not supported")
    return VkGraph(
        version=graph.string(0) or "",
        chain=tuple(
            OperatorCall(
                node_id=int(c.scalar(0, N.Uint32Flags)),
                name=c.string(1) or "",
                args=_ints(c, 2, N.Int32Flags),
            )
            for c in graph.tables(1)
        ),
        values=tuple(_value(v, i) for i, v in enumerate(graph.tables(2))),
        input_ids=_ints(graph, 3, N.Uint32Flags),
        output_ids=_ints(graph, 4, N.Uint32Flags),
        constants=tuple(
            Constant(
                offset=int(c.scalar(0, N.Uint64Flags)),
                length=int(c.scalar(1, N.Uint64Flags)),
                named_key=c.string(2) or None,
            )
            for c in graph.tables(5)
        ),
        constant_bytes=payload[bytes_offset : bytes_offset + bytes_size],
        storage_type_override=_enum(graph, 7, _STORAGE_TYPES, "storage type"),
        memory_layout_override=_enum(graph, 8, _MEMORY_LAYOUTS, "memory layout"),
    )


def _value(wrapper: Table, index: int) -> VkValue:
    kind, t = wrapper.union(0)
    name = _VALUE_KINDS[kind] if kind < len(_VALUE_KINDS) else f"kind {kind}"
    if name == "Null":
        return None
    if t is None:
        raise ValueError(f"value {index} is of unsupported kind {name}")
    if name == "Int":
        return int(t.scalar(0, N.Int64Flags))
    if name == "Double":
        return float(t.scalar(0, N.Float64Flags, 0.0))
    if name == "Bool":
        return bool(t.scalar(0, N.BoolFlags, False))
    if name == "VkTensor":
        return _tensor(t, index)
    if name == "IntList":
        return IntList(_ints(t, 0, N.Int64Flags))
    if name == "DoubleList":
        return DoubleList(tuple(float(x) for x in t.vector(0, N.Float64Flags)))
    if name == "BoolList":
        return BoolList(tuple(bool(x) for x in t.vector(0, N.BoolFlags)))
    if name == "ValueList":
        return ValueList(_ints(t, 0, N.Int32Flags))
    if name == "String":
        return t.string(0) or ""
    if name == "SymInt":
        return SymInt(int(t.scalar(0, N.Int32Flags)))
    raise ValueError(f"value {index} is of unsupported kind {name}")


def _tensor(t: Table, index: int) -> VkTensor:
    dtype = int(t.scalar(0, N.Int8Flags))
    staging = int(t.scalar(6, N.Int8Flags, _UNSET_DTYPE))
    for code in (dtype, staging):
        if code not in _DTYPES and code != _UNSET_DTYPE:
            raise ValueError(f"tensor value {index} has unknown data type {code}")
    if dtype == _UNSET_DTYPE:
        raise ValueError(f"tensor value {index} has no data type")
    return VkTensor(
        dtype=_DTYPES[dtype],
        dims=_ints(t, 1, N.Uint32Flags),
        constant_id=int(t.scalar(2, N.Int32Flags)),
        mem_obj_id=int(t.scalar(3, N.Int32Flags)),
        staging_dtype=_DTYPES.get(staging),
        storage_type=_enum(t, 4, _STORAGE_TYPES, "storage type"),
        memory_layout=_enum(t, 5, _MEMORY_LAYOUTS, "memory layout"),
    )


def _enum(t: Table, index: int, names: dict[int, str], what: str) -> str | None:
    """A storage type or memory layout; None for the default, which leaves the choice open."""
    code = int(t.scalar(index, N.Uint8Flags, _DEFAULT))
    if code == _DEFAULT:
        return None
    if code not in names:
        raise ValueError(f"unknown {what} {code}")
    return names[code]


def _ints(t: Table, index: int, flags: type) -> tuple[int, ...]:
    return tuple(int(x) for x in t.vector(index, flags))
