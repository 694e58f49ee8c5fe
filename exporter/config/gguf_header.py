"""The architecture a GGUF file declares (its `general.architecture` key), read from the file's
header alone: the gguf package's reader parses every key first, the tokenizer's vocabulary
included (17 s for SmolLM2-135M's), and this check runs while the job's config is composed.

The layout (GGUF versions 2 and 3, little-endian): magic b"GGUF", version u32, tensor count
u64, key count u64, then each key as a string (u64 length, UTF-8 bytes), its value type u32 and
its value; an array is its item type u32, its length u64 and the items.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from exporter.errors import ConfigError

MAGIC = b"GGUF"
ARCHITECTURE_KEY = "general.architecture"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# Value type -> bytes of one value, for the fixed-size types.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def architecture(path: Path) -> str:
    """The file's `general.architecture` (llama.cpp's name: llama, qwen2, gemma2, ...)."""
    try:
        with path.open("rb") as file:
            return _architecture(file, path)
    except (struct.error, UnicodeDecodeError, _Corrupt):
        raise ConfigError(
            f"model.checkpoint={path}: its GGUF header is truncated or corrupt."
        ) from None
    except OSError as error:
        raise ConfigError(f"model.checkpoint={path}: cannot read it: {error}") from None


class _Corrupt(Exception):
    pass


def _architecture(file: BinaryIO, path: Path) -> str:
    if file.read(4) != MAGIC:
        raise ConfigError(
            f"model.checkpoint={path}: not a GGUF file (it does not start with {MAGIC!r})."
        )
    (version,) = _unpack(file, "<I")
    if version not in _VERSIONS:
        raise ConfigError(
            f"model.checkpoint={path}: GGUF version {version}; transformers reads versions "
            f"{', '.join(map(str, _VERSIONS))}."
        )
    _tensors, keys = _unpack(file, "<QQ")
    for _ in range(keys):
        key = _string(file)
        (kind,) = _unpack(file, "<I")
        if key == ARCHITECTURE_KEY and kind == _STRING:
            return _string(file)
        _skip(file, kind)
    raise ConfigError(f"model.checkpoint={path}: its GGUF header has no {ARCHITECTURE_KEY}.")


def _skip(file: BinaryIO, kind: int) -> None:
    if kind == _STRING:
        _string(file)
    elif kind == _ARRAY:
        item, count = _unpack(file, "<IQ")
        if item in _SIZES:
            file.seek(_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip(file, item)
    elif kind in _SIZES:
        file.seek(_SIZES[kind], 1)
    else:
        raise _Corrupt


def _string(file: BinaryIO) -> str:
    (length,) = _unpack(file, "<Q")
    raw = file.read(length)
    if len(raw) != length:
        raise _Corrupt
    return raw.decode()


def _unpack(file: BinaryIO, layout: str) -> tuple[int, ...]:
    size = struct.calcsize(layout)
    raw = file.read(size)
    if len(raw) != size:
        raise _Corrupt
    return struct.unpack(layout, raw)
