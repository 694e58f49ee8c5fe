"""The architecture a GGUF file declares (its `general.architecture` key), read while the job's
config is composed, once the whole file is found to be what its header says: the gguf package's
reader parses every key first, the tokenizer's vocabulary of many thousand strings included,
and a file it cannot read fails seconds into the job, with the reader's own words.

The file is untrusted: every length and count it declares is checked against the bytes it has
before anything is read for it, so that a corrupt header cannot set the size of an allocation
or of a loop, and a truncated file is refused here rather than by transformers' loader.

The layout (GGUF versions 2 and 3, little-endian): magic b"GGUF", version u32, tensor count
u64, key count u64, then each key as a string (u64 length, UTF-8 bytes), its value type u32 and
its value; an array is its item type u32, its length u64 and the items. Then each tensor's
entry: its name (a string), its dimension count u32 and dimensions u64 (a row's length first),
its ggml type u32 and the offset u64 of its bytes in the data, which starts where the entries
end, rounded up to `general.alignment` (32 unless the file sets it).
"""

from __future__ import annotations

import mmap
import struct
from math import prod
from pathlib import Path

from exporter.errors import ConfigError

MAGIC = b"GGUF"
ARCHITECTURE_KEY = "general.architecture"
ALIGNMENT_KEY = "general.alignment"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_UINT32, _STRING, _ARRAY = 4, 8, 9
# Value type -> bytes of one value, for the fixed-size types.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# The GGUF specification's name of each value type, by its number.
_TYPE_NAMES = (
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "float32",
    "bool",
    "string",
    "array",
    "uint64",
    "int64",
    "float64",
)
# The fewest bytes an array's item takes (a string: its length): what a count of them must find
# left in the file before the first is read.
_LEAST_ITEM_BYTES = {**_SIZES, _STRING: 8}
# The fewest bytes of a key (its name's length, its type, a one-byte value) and of a tensor's
# entry (its name's length, its dimension count, its type and offset).
_LEAST_KEY_BYTES, _LEAST_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8
# ggml's GGML_MAX_DIMS: llama.cpp refuses a tensor of more.
_MAX_DIMS = 4


def architecture(path: Path) -> str:
    """The file's `general.architecture` (llama.cpp's name: llama, qwen2, gemma2, ...), once its
    header is read to the end and every tensor it lists lies inside the file."""
    try:
        with path.open("rb") as file:
            if file.read(len(MAGIC)) != MAGIC:
                raise ConfigError(
                    f"model.checkpoint={path}: not a GGUF file (it does not start with {MAGIC!r})."
                )
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _Reader(data, path).architecture()
    except _Corrupt as error:
        raise ConfigError(
            f"model.checkpoint={path}: its GGUF {error.part} is truncated or corrupt: {error}; "
            "download or convert the file again."
        ) from None
    except OSError as error:
        raise ConfigError(f"model.checkpoint={path}: cannot read it: {error}") from None


class _Corrupt(Exception):
    """What in the file is not as its header declares; `part`: the header or the tensor data."""

    def __init__(self, reason: str, part: str = "header") -> None:
        super().__init__(reason)
        self.part = part


class _Reader:
    """Reads the mapped file front to back, each size checked against the bytes left first."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.at = data, path, len(MAGIC)

    def architecture(self) -> str:
        (version,) = self.unpack("<I", "the version")
        if version not in _VERSIONS:
            raise ConfigError(
                f"model.checkpoint={self.path}: GGUF version {version}; transformers reads "
                f"versions {', '.join(map(str, _VERSIONS))}."
            )
        tensors, keys = self.unpack("<QQ", "the tensor and key counts")
        self.need(keys * _LEAST_KEY_BYTES, f"the keys ({keys})", least=True)
        found, alignment, names = None, _DEFAULT_ALIGNMENT, set()
        for number in range(1, keys + 1):
            key = self.unique_name(names, "key", number)
            (kind,) = self.unpack("<I", f"the type of key {key}")
            if key == ARCHITECTURE_KEY and kind == _STRING:
                found = self.string(f"the value of {key}")
            elif key == ALIGNMENT_KEY:
                alignment = self.alignment(kind)
            else:
                self.skip(kind, f"the value of key {key}")
        self.check_tensors(tensors, alignment)
        if found is None:
            raise ConfigError(
                f"model.checkpoint={self.path}: its GGUF header has no {ARCHITECTURE_KEY}."
            )
        return found

    def unique_name(self, names: set[str], what: str, number: int) -> str:
        """The name of the `number`th key or tensor, added to `names`, which must not hold it."""
        name = self.string(f"the name of {what} {number}")
        if name in names:
            raise _Corrupt(f"{what} {name} appears twice")
        names.add(name)
        return name

    def alignment(self, kind: int) -> int:
        """The value of general.alignment: a power of two, as the gguf reader and llama.cpp
        require."""
        if kind != _UINT32:
            raise _Corrupt(f"{ALIGNMENT_KEY} has type {kind}, not uint32 ({_UINT32})")
        (alignment,) = self.unpack("<I", f"the value of {ALIGNMENT_KEY}")
        if alignment == 0 or alignment & (alignment - 1):
            raise _Corrupt(f"{ALIGNMENT_KEY} is {alignment}, not a power of two")
        return alignment

    def check_tensors(self, count: int, alignment: int) -> None:
        """Reads the tensors' entries; each tensor's bytes must lie inside the file."""
        # Imported here: it loads numpy, which only a GGUF file needs. Its table of ggml types is
        # the one that transformers' reader of the file (the gguf package's) goes by.
        try:
            from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        except ImportError:
            raise ConfigError(
                f"model.checkpoint={self.path}: transformers reads GGUF files with the gguf "
                "package, which is not installed: pip install gguf."
            ) from None

        self.need(count * _LEAST_TENSOR_BYTES, f"the tensor entries ({count})", least=True)
        tensors, names = [], set()
        for number in range(1, count + 1):
            name = self.unique_name(names, "tensor", number)
            (dims,) = self.unpack("<I", f"the dimension count of tensor {name}")
            if dims > _MAX_DIMS:
                raise _Corrupt(f"tensor {name} has {dims} dimensions; GGUF allows {_MAX_DIMS}")
            shape = self.unpack(f"<{dims}Q", f"the shape of tensor {name}")
            kind, offset = self.unpack("<IQ", f"the type and offset of tensor {name}")
            if kind not in GGML_QUANT_SIZES:
                raise _Corrupt(f"tensor {name} has ggml type {kind}, which the gguf package lacks")
            type_name = GGMLQuantizationType(kind).name
            block, block_bytes = GGML_QUANT_SIZES[kind]
            row = shape[0] if shape else 1
            if row % block:
                raise _Corrupt(
                    f"tensor {name} ({type_name}) has rows of {row} values, not whole blocks of "
                    f"{block}"
                )
            tensors.append((name, type_name, offset, prod(shape) // block * block_bytes))
        data_start = -(-self.at // alignment) * alignment
        for name, type_name, offset, size in tensors:
            if data_start + offset + size > len(self.data):
                raise _Corrupt(
                    f"tensor {name} ({type_name}) needs bytes {data_start + offset} to "
                    f"{data_start + offset + size}, and the file has {len(self.data)}",
                    part="tensor data",
                )

    def skip(self, kind: int, what: str) -> None:
        """Steps over one value of type `kind`."""
        if kind == _STRING:
            self.string(what)
        elif kind in _SIZES:
            self.need(_SIZES[kind], what)
            self.at += _SIZES[kind]
        elif kind == _ARRAY:
            item, count = self.unpack("<IQ", f"the item type and length of {what}")
            if item == _ARRAY:
                raise _Corrupt(f"{what} is an array of arrays, which llama.cpp does not read")
            if item not in _LEAST_ITEM_BYTES:
                raise _Corrupt(f"{what} is an array of type {item}, which GGUF does not define")
            items = f"{what} ({count} {_TYPE_NAMES[item]}s)"
            self.need(count * _LEAST_ITEM_BYTES[item], items, least=True)
            if item == _STRING:
                item_what = f"an item of {what}"
                for _ in range(count):
                    self.string(item_what)
            else:
                self.at += count * _SIZES[item]
        else:
            raise _Corrupt(f"{what} has type {kind}, which GGUF does not define")

    def string(self, what: str) -> str:
        """A u64 length, then that many bytes of UTF-8."""
        self.need(8, what)
        (length,) = struct.unpack_from("<Q", self.data, self.at)
        self.at += 8
        self.need(length, what)
        try:
            text = self.data[self.at : self.at + length].decode()
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} at byte {self.at} is not UTF-8") from None
        self.at += length
        return text

    def unpack(self, layout: str, what: str) -> tuple[int, ...]:
        size = struct.calcsize(layout)
        self.need(size, what)
        values = struct.unpack_from(layout, self.data, self.at)
        self.at += size
        return values

    def need(self, size: int, what: str, least: bool = False) -> None:
        """Refuses to read `size` bytes (`least`: at least) for `what` where the file has fewer
        left."""
        if size > len(self.data) - self.at:
            bytes_needed = f"at least {size}" if least else size
            raise _Corrupt(
                f"reading {what} at byte {self.at} takes {bytes_needed} bytes, and the file has "
                f"{len(self.data)}"
            )
