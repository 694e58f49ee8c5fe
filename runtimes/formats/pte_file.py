"""Read an ExecuTorch `.pte` without executorch, for runtimes on machines that lack it.

Follows executorch's `exir/_serialize/program.fbs` (file identifier "ET12") and the extended
header ("eh00") that `exir/_serialize/_program.py` writes after the flatbuffer's first 8 bytes.
Field indices below are the fields' positions in those schema tables.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import torch
from flatbuffers import number_types as N

from runtimes.formats.flatbuffer_table import Table

_IDENTIFIER = b"ET12"
_EXTENDED_HEADER_MAGIC = b"eh00"

# scalar_type.fbs's ScalarType values (shared by .pte and .ptd files).
SCALAR_TYPES: dict[int, torch.dtype] = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    12: torch.qint8,
    13: torch.quint8,
    14: torch.qint32,
    15: torch.bfloat16,
    16: torch.quint4x2,
    17: torch.quint2x4,
    22: torch.bits16,
    23: torch.float8_e5m2,
    24: torch.float8_e4m3fn,
    25: torch.float8_e5m2fnuz,
    26: torch.float8_e4m3fnuz,
    27: torch.uint16,
    28: torch.uint32,
    29: torch.uint64,
}

# Union members, in schema order from 1 (0 is "NONE").
_VALUE_KINDS = (
    "NONE",
    "Null",
    "Int",
    "Bool",
    "Double",
    "Tensor",
    "String",
    "IntList",
    "DoubleList",
    "BoolList",
    "TensorList",
    "OptionalTensorList",
)
_INSTRUCTION_KINDS = (
    "NONE",
    "KernelCall",
    "DelegateCall",
    "MoveCall",
    "JumpFalseCall",
    "FreeCall",
)
_INLINE, _SEGMENT = 0, 1  # DataLocation
_EXTERNAL = 1  # TensorDataLocation


@dataclass(frozen=True)
class TensorValue:
    dtype: torch.dtype
    sizes: tuple[int, ...]  # for a dynamic tensor: its upper bound
    dim_order: tuple[int, ...]
    # Data of a constant tensor; None for planned tensors and inputs, which have none.
    constant: bytes | None
    shape_dynamism: int  # 0 static, 1 dynamic with upper bound, 2 unbounded


@dataclass(frozen=True)
class IntList:
    """An int list whose items are indices of other values (of Int or SymInt), not ints."""

    value_indices: tuple[int, ...]


@dataclass(frozen=True)
class TensorList:
    value_indices: tuple[int, ...]


@dataclass(frozen=True)
class OptionalTensorList:
    value_indices: tuple[int, ...]  # -1 for None


EValue = (
    None
    | int
    | bool
    | float
    | str
    | TensorValue
    | IntList
    | tuple[float, ...]  # DoubleList
    | tuple[bool, ...]  # BoolList
    | TensorList
    | OptionalTensorList
)


@dataclass(frozen=True)
class KernelCall:
    op_index: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class DelegateCall:
    delegate_index: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class MoveCall:
    move_from: int
    move_to: int


@dataclass(frozen=True)
class JumpFalseCall:
    cond_value_index: int
    destination_instruction: int


@dataclass(frozen=True)
class FreeCall:
    value_index: int


Instruction = KernelCall | DelegateCall | MoveCall | JumpFalseCall | FreeCall


@dataclass(frozen=True)
class Operator:
    name: str  # e.g. "aten::add"
    overload: str  # e.g. "out"; may be empty


@dataclass(frozen=True)
class Delegate:
    backend_id: str
    payload: bytes
    compile_specs: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class ExecutionPlan:
    name: str
    values: tuple[EValue, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    instructions: tuple[Instruction, ...]
    operators: tuple[Operator, ...]
    delegates: tuple[Delegate, ...]


@dataclass(frozen=True)
class PteFile:
    plans: tuple[ExecutionPlan, ...]
    named_data: dict[str, bytes]


def read_pte(path_or_bytes: str | os.PathLike[str] | bytes) -> PteFile:
    """Reads a whole `.pte`; a malformed one raises ValueError naming the file."""
    if isinstance(path_or_bytes, bytes | bytearray | memoryview):
        name, data = "PTE data", bytes(path_or_bytes)
    else:
        name = os.fspath(path_or_bytes)
        with open(name, "rb") as f:
            data = f.read()
    try:
        return _Reader(data).read()
    except (ValueError, IndexError, struct.error) as e:
        raise ValueError(f"{name}: not a readable ExecuTorch program: {e}") from e


class _Reader:
    """Holds the file and its segments while the program's tables are read."""

    def __init__(self, data: bytes) -> None:
        program_size, self._segment_base = _extended_header(data)
        self._data = data
        self._program = Table.root(data[:program_size], _IDENTIFIER)
        self._segments = tuple(
            (
                int(s.scalar(0, N.Uint64Flags)),  # offset
                int(s.scalar(1, N.Uint64Flags)),  # size
            )
            for s in self._program.tables(4)
        )

    def read(self) -> PteFile:
        p = self._program
        constants = self._constants(p)
        named_data = {
            _required_string(n, 0, "named data key"): self._segment(int(n.scalar(1, N.Uint32Flags)))
            for n in p.tables(7)
        }
        inline_delegate_data = tuple(d.blob(0) for d in p.tables(3))
        plans = tuple(self._plan(t, constants, inline_delegate_data) for t in p.tables(1))
        return PteFile(plans=plans, named_data=named_data)

    def _segment(self, index: int) -> bytes:
        if self._segment_base == 0:
            raise ValueError(f"segment {index} is used, but the file has no extended header")
        if not 0 <= index < len(self._segments):
            raise ValueError(f"segment {index} does not exist ({len(self._segments)} segments)")
        offset, size = self._segments[index]
        start = self._segment_base + offset
        if start + size > len(self._data):
            raise ValueError(
                f"segment {index} ends at byte {start + size}, past the file's "
                f"{len(self._data)} bytes (truncated?)"
            )
        return self._data[start : start + size]

    def _constants(self, program: Table) -> _Constants:
        legacy = program.tables(2)
        if legacy:
            return _Constants(buffers=tuple(b.blob(0) for b in legacy))
        segment = program.table(5)
        if segment is None:
            return _Constants()
        offsets = tuple(int(o) for o in segment.vector(1, N.Uint64Flags))
        if len(offsets) <= 1:  # offsets[0] is reserved for non-constant tensors
            return _Constants()
        return _Constants(
            segment=self._segment(int(segment.scalar(0, N.Uint32Flags))), offsets=offsets
        )

    def _plan(
        self, t: Table, constants: _Constants, inline_delegate_data: tuple[bytes, ...]
    ) -> ExecutionPlan:
        name = t.string(0) or ""
        chains = t.tables(5)
        if len(chains) > 1:
            raise ValueError(f"plan {name!r} has {len(chains)} chains; only one is supported")
        return ExecutionPlan(
            name=name,
            values=tuple(_value(v, i, constants) for i, v in enumerate(t.tables(2))),
            inputs=_ints(t, 3, N.Int32Flags),
            outputs=_ints(t, 4, N.Int32Flags),
            instructions=tuple(_instruction(i) for i in chains[0].tables(2)) if chains else (),
            operators=tuple(
                Operator(_required_string(o, 0, "operator name"), o.string(1) or "")
                for o in t.tables(6)
            ),
            delegates=tuple(self._delegate(d, inline_delegate_data) for d in t.tables(7)),
        )

    def _delegate(self, t: Table, inline_delegate_data: tuple[bytes, ...]) -> Delegate:
        backend_id = _required_string(t, 0, "delegate id")
        processed = t.table(1)
        if processed is None:
            raise ValueError(f"delegate {backend_id!r} has no processed data")
        location = processed.scalar(0, N.Int8Flags)
        index = int(processed.scalar(1, N.Uint32Flags))
        if location == _SEGMENT:
            payload = self._segment(index)
        elif location == _INLINE:
            if index >= len(inline_delegate_data):
                raise ValueError(f"delegate {backend_id!r} refers to missing inline data {index}")
            payload = inline_delegate_data[index]
        else:
            raise ValueError(f"delegate {backend_id!r} has unknown data location {location}")
        compile_specs = tuple((s.string(0) or "", s.blob(1)) for s in t.tables(2))
        return Delegate(backend_id=backend_id, payload=payload, compile_specs=compile_specs)


@dataclass(frozen=True)
class _Constants:
    """Where constant tensors' data lives: a segment at offsets, or the legacy inline buffers."""

    segment: bytes = b""
    offsets: tuple[int, ...] = ()
    buffers: tuple[bytes, ...] = ()

    def get(self, index: int, nbytes: int) -> bytes:
        if self.buffers:
            if index >= len(self.buffers):
                raise ValueError(f"constant buffer {index} does not exist")
            data = self.buffers[index]
        else:
            if index >= len(self.offsets):
                raise ValueError(f"constant {index} does not exist ({len(self.offsets)} offsets)")
            data = self.segment[self.offsets[index] : self.offsets[index] + nbytes]
        if len(data) < nbytes:
            raise ValueError(f"constant {index} has {len(data)} bytes, expected {nbytes}")
        return data[:nbytes]


def input_sizes(path: str | os.PathLike[str], method: str = "forward") -> list[EValue]:
    """Each input of `method` as the program declares it: a TensorValue's sizes are a dynamic
    dim's upper bound, which the runtime refuses to exceed. Reads the program's flatbuffer only,
    not the constants and delegate data read_pte reads (a 1B model's .pte is gigabytes, its
    program kilobytes); a malformed one raises ValueError naming the file."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            head = f.read(40)
            program_size, _ = _extended_header(head, os.fstat(f.fileno()).st_size)
            f.seek(0)
            program = Table.root(f.read(program_size), _IDENTIFIER)
        for plan in program.tables(1):
            if plan.string(0) == method:
                values = plan.tables(2)
                # Inputs hold no constant data: their values need no constants to read.
                return [_value(values[i], i, _Constants()) for i in _ints(plan, 3, N.Int32Flags)]
    except (ValueError, IndexError, struct.error) as e:
        raise ValueError(f"{name}: not a readable ExecuTorch program: {e}") from e
    raise ValueError(f"{name}: the program has no method {method!r}")


def _extended_header(data: bytes, size: int | None = None) -> tuple[int, int]:
    """The program's size and the segments' base offset (0 when the file has no segments), from
    the file's start `data` and the file's `size` (the length of `data` where it is all)."""
    size = len(data) if size is None else size
    if size < 8:
        raise ValueError(f"{size} bytes is too short for a program")
    if data[8:12] != _EXTENDED_HEADER_MAGIC:
        return size, 0
    if len(data) < 32:
        raise ValueError("extended header is truncated")
    length, program_size, segment_base = struct.unpack_from("<IQQ", data, 12)
    segment_data_size = struct.unpack_from("<Q", data, 32)[0] if length >= 32 else 0
    end = max(program_size, segment_base + segment_data_size)
    if end > size:
        raise ValueError(f"its header says {end} bytes, the file has {size} (truncated?)")
    return program_size, segment_base


def _value(wrapper: Table, index: int, constants: _Constants) -> EValue:
    kind, t = wrapper.union(0)
    name = _VALUE_KINDS[kind] if kind < len(_VALUE_KINDS) else f"kind {kind}"
    if name == "Null":
        return None
    if t is None:
        raise ValueError(f"value {index} is of unsupported kind {name}")
    if name == "Int":
        return int(t.scalar(0, N.Int64Flags))
    if name == "Bool":
        return bool(t.scalar(0, N.BoolFlags, False))
    if name == "Double":
        return float(t.scalar(0, N.Float64Flags, 0.0))
    if name == "String":
        return t.string(0) or ""
    if name == "Tensor":
        return _tensor(t, index, constants)
    if name == "IntList":
        return IntList(_ints(t, 0, N.Int64Flags))
    if name == "DoubleList":
        return tuple(float(x) for x in t.vector(0, N.Float64Flags))
    if name == "BoolList":
        return tuple(bool(x) for x in t.vector(0, N.BoolFlags))
    if name == "TensorList":
        return TensorList(_ints(t, 0, N.Int32Flags))
    if name == "OptionalTensorList":
        return OptionalTensorList(_ints(t, 0, N.Int32Flags))
    raise ValueError(f"value {index} is of unsupported kind {name}")


def _tensor(t: Table, index: int, constants: _Constants) -> TensorValue:
    scalar_type = int(t.scalar(0, N.Int8Flags))
    if scalar_type not in SCALAR_TYPES:
        raise ValueError(f"tensor value {index} has unknown scalar type {scalar_type}")
    dtype = SCALAR_TYPES[scalar_type]
    sizes = _ints(t, 2, N.Int32Flags)
    data_buffer_idx = int(t.scalar(5, N.Uint32Flags))
    constant = None
    if data_buffer_idx > 0:
        extra = t.table(9)
        if extra is not None and extra.scalar(2, N.Int8Flags) == _EXTERNAL:
            raise ValueError(
                f"tensor value {index} ({extra.string(1)}) has its data outside the file; "
                "external data is not supported"
            )
        if t.table(6) is not None:  # allocation_info: a mutable tensor with an initial state
            raise ValueError(
                f"tensor value {index} is mutable with an initial state; not supported"
            )
        constant = constants.get(data_buffer_idx, math.prod(sizes) * dtype.itemsize)
    return TensorValue(
        dtype=dtype,
        sizes=sizes,
        dim_order=_ints(t, 3, N.Uint8Flags),
        constant=constant,
        shape_dynamism=int(t.scalar(8, N.Int8Flags)),
    )


def _instruction(wrapper: Table) -> Instruction:
    kind, t = wrapper.union(0)
    name = _INSTRUCTION_KINDS[kind] if kind < len(_INSTRUCTION_KINDS) else f"kind {kind}"
    if t is None or name not in _INSTRUCTION_KINDS[1:]:
        raise ValueError(f"unsupported instruction kind {name}")
    first = int(t.scalar(0, N.Int32Flags))
    if name == "KernelCall":
        return KernelCall(op_index=first, args=_ints(t, 1, N.Int32Flags))
    if name == "DelegateCall":
        return DelegateCall(delegate_index=first, args=_ints(t, 1, N.Int32Flags))
    if name == "MoveCall":
        return MoveCall(move_from=first, move_to=int(t.scalar(1, N.Int32Flags)))
    if name == "JumpFalseCall":
        return JumpFalseCall(
            cond_value_index=first, destination_instruction=int(t.scalar(1, N.Int32Flags))
        )
    return FreeCall(value_index=first)


def _ints(t: Table, index: int, flags: type) -> tuple[int, ...]:
    return tuple(int(x) for x in t.vector(index, flags))


def _required_string(t: Table, index: int, what: str) -> str:
    s = t.string(index)
    if s is None:
        raise ValueError(f"{what} is missing")
    return s
