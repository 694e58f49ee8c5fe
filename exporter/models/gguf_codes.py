"""The quantized tensors of a GGUF checkpoint as the file stores them, so that the quantize stage
can carry the file's own codes instead of rounding its dequantized weights a second time.

llama.cpp stores a quantized weight in blocks along each row. Every type read here comes down to
integer codes and, per group of a row, a scale and an offset:

    value = code * scale + offset

with `code * scale` and the sum each what the gguf package's own dequantization computes, in
float32, so `StoredCodes.dequantized()` equals `gguf.dequantize()` bit for bit:

| type | bits | group | code | scale | offset |
| --- | --- | --- | --- | --- | --- |
| Q4_0 | 4 | 32 | q - 8 | d | 0 |
| Q4_1 | 4 | 32 | q | d | m |
| Q8_0 | 8 | 32 | q (signed) | d | 0 |
| Q4_K | 4 | 32 | q | d * sc (6-bit sub-block scale) | -dmin * m (6-bit sub-block min) |
| Q6_K | 6 | 16 | q - 32 | d * sc (int8 sub-block scale) | 0 |

(d, m, dmin: the block's float16 numbers, widened.) Other types (Q5_*, Q2_K, Q3_K, Q5_K, the
IQ types) are not read: the model keeps their dequantized weights and the quantize stage plans
them like float ones.

transformers reorders some weights as it reads them (a Llama's query and key rows, from
llama.cpp's rotary layout). The codes are reordered as transformers reorders the values: its own
tensor processor is run on the row numbers, and a tensor it changes in any other way than whole
rows is not carried. Every tensor carried is checked against the model's weight that
transformers loaded: its dequantized codes must equal it exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Types whose codes are read, with the bits of a code and the width of a group.
READ_TYPES = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32), "Q6_K": (6, 16)}


@dataclass(frozen=True)
class StoredCodes:
    """One weight [rows, cols] as the file stores it: int8 codes [rows, cols], and per group of
    `group` codes along a row a float32 scale and offset [rows, cols // group]."""

    ggml_type: str
    bits: int
    group: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return rows, cols

    @property
    def signed(self) -> bool:
        """Whether the codes are centred on 0 (no offset) rather than counted from 0."""
        return self.ggml_type in ("Q4_0", "Q8_0", "Q6_K")

    def dequantized(self) -> torch.Tensor:
        """The weight in float32, as the gguf package dequantizes it."""
        rows, cols = self.shape
        grouped = self.codes.to(torch.float32).reshape(rows, cols // self.group, self.group)
        values = grouped * self.scale.unsqueeze(-1)
        if not self.signed:
            values = values + self.offset.unsqueeze(-1)
        return values.reshape(rows, cols)

    def rows(self, order: torch.Tensor) -> StoredCodes:
        return StoredCodes(
            self.ggml_type,
            self.bits,
            self.group,
            self.codes[order],
            self.scale[order],
            self.offset[order],
        )


@dataclass(frozen=True)
class NotCarried:
    """A quantized tensor of the file whose codes the model does not get, and why."""

    tensor: str
    ggml_type: str
    reason: str

    def line(self) -> str:
        return f"{self.tensor} ({self.ggml_type}): {self.reason}"


@dataclass(frozen=True)
class FileQuantization:
    """What a GGUF file quantized: the codes of each weight read, by the model's parameter name
    (`model.layers.0.self_attn.q_proj.weight`), and the quantized tensors not read."""

    file: Path
    codes: dict[str, StoredCodes]
    not_carried: tuple[NotCarried, ...]

    def by_layer(self, module: torch.nn.Module) -> dict[str, StoredCodes]:
        """The codes by the name of the layer of `module` whose weight they are (`module` holds
        the model that read the file, under a prefix): a weight two layers share (a tied output
        projection) gives both the codes."""
        by_tensor = {}
        for name, weight in module.named_parameters(remove_duplicate=False):
            for stored_name, stored in self.codes.items():
                if name == stored_name or name.endswith(f".{stored_name}"):
                    by_tensor[id(weight)] = stored
        return {
            name.removesuffix(".weight"): by_tensor[id(weight)]
            for name, weight in module.named_parameters(remove_duplicate=False)
            if name.endswith(".weight") and id(weight) in by_tensor
        }

    def types(self) -> dict[str, int]:
        """How many weights of each type were read."""
        counts: dict[str, int] = {}
        for stored in self.codes.values():
            counts[stored.ggml_type] = counts.get(stored.ggml_type, 0) + 1
        return counts


def read(path: Path, model: torch.nn.Module) -> FileQuantization:
    """The quantized weights of the GGUF file `path` that `model` (transformers' model that
    loaded it) has, as codes."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf.GGUFReader(path)
    architecture = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = _model_names(gguf, architecture, model)
    weights = model.state_dict()
    codes: dict[str, StoredCodes] = {}
    not_carried = []
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16", "F64"):
            continue
        name = names.get(tensor.name)
        if name is None:
            reason = "no weight of the model has its name"
            not_carried.append(NotCarried(tensor.name, kind, reason))
            continue
        if kind not in READ_TYPES:
            not_carried.append(NotCarried(tensor.name, kind, "a type whose codes are not read"))
            continue
        stored = _decoded(kind, tensor)
        order = _row_order(processor, tensor.name, stored.shape)
        if order is None:
            reason = "transformers reorders it otherwise than by whole rows"
            not_carried.append(NotCarried(tensor.name, kind, reason))
            continue
        stored = stored.rows(order)
        if not torch.equal(stored.dequantized(), weights[name].to(torch.float32)):
            reason = "its codes do not dequantize to the weight transformers loaded"
            not_carried.append(NotCarried(tensor.name, kind, reason))
            continue
        codes[name] = stored
    return FileQuantization(Path(path), codes, tuple(not_carried))


def _model_names(gguf: object, architecture: str, model: torch.nn.Module) -> dict[str, str]:
    """The model's parameter name of each of the file's tensor names, by gguf's own table of
    llama.cpp's names for `architecture` (one pass over the model's weights: transformers'
    loader builds the table again for every submodule, seconds for a 30-layer model)."""
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture), None)
    if arch is None:
        return {}
    table = gguf.get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    names = {}
    for name in model.state_dict():
        base, _, suffix = name.rpartition(".")
        found = table.get_name(base)
        if found is not None:
            names.setdefault(f"{found}.{suffix}", name)
    return names


def _row_order(processor: object, name: str, shape: tuple[int, int]) -> torch.Tensor | None:
    """Where transformers' processor puts each row of the tensor `name`: the file's row of each
    of the model's rows; None where it moves values otherwise than by whole rows."""
    rows, cols = shape
    index = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    moved = np.asarray(processor.process(weights=index, name=name).weights)
    if moved.shape != (rows, cols):
        return None
    order = moved[:, 0] // cols
    if not np.array_equal(moved, order[:, None] * cols + np.arange(cols)):
        return None
    return torch.from_numpy(order)


def _decoded(kind: str, tensor: object) -> StoredCodes:
    """The tensor's blocks [rows, blocks per row, bytes per block] as codes, scales, offsets."""
    cols, rows = (int(n) for n in tensor.shape[:2])
    bits, group = READ_TYPES[kind]
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
    per_block = _BLOCKS[kind]
    blocks = blocks.reshape(rows, -1, per_block.bytes)
    codes, scale, offset = per_block.decode(blocks)
    return StoredCodes(
        kind,
        bits,
        group,
        torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, cols // group))),
        torch.from_numpy(np.ascontiguousarray(offset.reshape(rows, cols // group))),
    )


def _half(raw: np.ndarray) -> np.ndarray:
    """Two bytes per value, read as float16 and widened to float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A block's bytes of two codes each: the low nibbles first, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _half(blocks[..., 0:2])
    codes = _nibbles(blocks[..., 2:]).astype(np.int8) - np.int8(8)
    return codes, d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        _nibbles(blocks[..., 4:]).astype(np.int8),
        _half(blocks[..., 0:2]),
        _half(blocks[..., 2:4]),
    )


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _half(blocks[..., 0:2])
    return np.ascontiguousarray(blocks[..., 2:]).view(np.int8), d, np.zeros_like(d)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """256 codes a block: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of codes
    (each 32 bytes: one sub-block in the low nibbles, the next in the high ones)."""
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    packed = blocks[..., 4:16]
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1)
    quads = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)
    codes = np.stack([quads & 0x0F, quads >> 4], axis=-2).reshape(*blocks.shape[:-1], 256)
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * mins.astype(np.float32))
    return codes.astype(np.int8), scale, offset


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """256 codes a block: 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales of
    16 codes each, d. Each half of 128 codes takes 64 low-nibble bytes (low then high nibbles)
    and 32 high-bit bytes (four pairs each, one per quarter)."""
    lead = blocks.shape[:-1]
    low = blocks[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(*lead, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = (blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> shifts) & 0x03
    codes = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _half(blocks[..., 208:210])[..., None] * scales
    return codes.reshape(*lead, 256), scale, np.zeros_like(scale)


@dataclass(frozen=True)
class _Block:
    bytes: int
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


_BLOCKS = {
    "Q4_0": _Block(18, _q4_0),
    "Q4_1": _Block(20, _q4_1),
    "Q8_0": _Block(34, _q8_0),
    "Q4_K": _Block(144, _q4_k),
    "Q6_K": _Block(210, _q6_k),
}
