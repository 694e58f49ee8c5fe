"""Read flatbuffer tables by field index, so the readers need neither flatc nor generated code.

A field's index is its position in the schema's table declaration (a union takes two: its type
byte, then its value). Out-of-range reads surface as `struct.error`, `IndexError` or numpy's
`ValueError`; callers turn them into an error that names what they were reading. Offsets are
checked before flatbuffers sees them: it answers a corrupt one with a TypeError.
"""

from __future__ import annotations

import struct

import numpy as np
from flatbuffers import number_types as N
from flatbuffers import util
from flatbuffers.table import Table as _FlatbuffersTable


class Table:
    """One flatbuffer table: the buffer and the table's position in it.

    Scalar reads take the field's type as one of `flatbuffers.number_types`' flags classes,
    e.g. `N.Int32Flags`.
    """

    __slots__ = ("_t",)

    def __init__(self, buf: bytes, pos: int) -> None:
        _check_range(buf, pos, 4, "table")
        self._t = _FlatbuffersTable(buf, pos)
        _check_range(buf, pos - self._t.Get(N.SOffsetTFlags, pos), 4, "vtable")

    @classmethod
    def root(cls, buf: bytes, identifier: bytes) -> Table:
        """The buffer's root table; a wrong file identifier raises ValueError."""
        if len(buf) < 8:
            raise ValueError(f"{len(buf)} bytes is too short for a flatbuffer")
        found = bytes(util.GetBufferIdentifier(buf, 0))
        if found != identifier:
            raise ValueError(f"file identifier is {found!r}, expected {identifier!r}")
        return cls(buf, struct.unpack_from("<I", buf, 0)[0])

    def _field(self, index: int) -> int:
        """The field's offset from the table start; 0 when absent (so it reads as its default)."""
        return self._t.Offset(4 + 2 * index)

    def scalar(self, index: int, flags: type, default: float = 0) -> int | float | bool:
        off = self._field(index)
        return self._t.Get(flags, self._t.Pos + off) if off else default

    def string(self, index: int) -> str | None:
        off = self._field(index)
        return self._t.String(self._t.Pos + off).decode() if off else None

    def table(self, index: int) -> Table | None:
        off = self._field(index)
        return Table(self._t.Bytes, self._t.Indirect(self._t.Pos + off)) if off else None

    def vector(self, index: int, flags: type) -> np.ndarray:
        """A vector of scalars, copied out of the buffer; empty when absent."""
        off = self._field(index)
        if not off:
            return np.zeros(0, N.to_numpy_type(flags))
        return self._t.GetVectorAsNumpy(flags, off).copy()

    def blob(self, index: int) -> bytes:
        """A [ubyte] vector, e.g. a blob of data; empty when absent."""
        off = self._field(index)
        if not off:
            return b""
        start, length = self._t.Vector(off), self._t.VectorLen(off)
        _check_range(self._t.Bytes, start, length, "vector")
        return bytes(self._t.Bytes[start : start + length])

    def tables(self, index: int) -> tuple[Table, ...]:
        """A vector of tables; empty when absent."""
        off = self._field(index)
        if not off:
            return ()
        start, length = self._t.Vector(off), self._t.VectorLen(off)
        width = N.UOffsetTFlags.bytewidth
        _check_range(self._t.Bytes, start, length * width, "vector")
        return tuple(
            Table(self._t.Bytes, self._t.Indirect(start + i * width)) for i in range(length)
        )

    def union(self, index: int) -> tuple[int, Table | None]:
        """A union declared at `index`: its type (0 when absent) and its table."""
        return int(self.scalar(index, N.Uint8Flags)), self.table(index + 1)


def _check_range(buf: bytes, start: int, size: int, what: str) -> None:
    if start < 0 or start + size > len(buf):
        raise IndexError(f"{what} of {size} bytes at {start} is outside the {len(buf)}-byte buffer")
