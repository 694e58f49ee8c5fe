"""What every delegated op is built from: tensors in GPU buffers sized at their upper bound, and
dispatches (a WGSL pipeline, its bind group and its uniform parameters) recorded into one pass.

An op is built once, at load, from its resolved arguments; each execute calls `resize` (the op's
resize rule: live output dims from live input dims and symbolic ints), then `encode`, which
writes the live parameters and records the dispatches. Buffers and bind groups never change
after load.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import wgpu

# The most dims any kernel indexes; lower-rank tensors are padded with leading 1s.
MAX_RANK = 6
# 48 u32 words of uniform parameters per dispatch (12 vec4, as uniform arrays need).
PARAM_WORDS = 48
WORKGROUP = 64
# Per-dispatch-dimension limit of WebGPU; larger grids spill into y.
MAX_GROUPS = 65535


class UnsupportedOp(ValueError):
    """The payload asks for something this runtime cannot run: refused at load, never guessed."""


@dataclass
class SymInt:
    """A symbolic int of the graph (a live size); ops read `value` after earlier ops set it."""

    value: int = 0


@dataclass
class GpuTensor:
    """A contiguous tensor in its own storage buffer (or a slot shared by memory planning)."""

    # WGSL element type: f32 for float32, i32 for int32, int64 (downcast) and bool.
    wgsl: str
    # The tensor's dtype on the host side ("float32", "int32", "int64", "bool").
    host_dtype: str
    max_dims: tuple[int, ...]
    buffer: wgpu.GPUBuffer
    dims: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.dims:
            self.dims = list(self.max_dims)

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def rank(self) -> int:
        return len(self.max_dims)

    def set_dims(self, dims: Sequence[int], op: str) -> None:
        """The op's resize rule gave these live dims; they must fit the buffer sized at load."""
        dims = [int(d) for d in dims]
        if len(dims) != len(self.max_dims) or math.prod(dims) > math.prod(self.max_dims):
            raise ValueError(
                f"{op}: its output would be {dims}, which does not fit the buffer planned "
                f"for its upper bound {list(self.max_dims)}"
            )
        self.dims = dims


def contiguous_strides(dims: Sequence[int]) -> list[int]:
    strides = [1] * len(dims)
    for d in range(len(dims) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(dims[d + 1], 1)
    return strides


def live(value: Any) -> Any:
    """The live value of an argument: a symbolic int's current value, lists element-wise."""
    if isinstance(value, SymInt):
        return value.value
    if isinstance(value, list | tuple):
        return [live(v) for v in value]
    return value


class Params:
    """The uniform words of one dispatch: u32 slots, and float/int scalars bit-cast into them."""

    def __init__(self) -> None:
        self.words = [0] * PARAM_WORDS

    def u32(self, index: int, value: int) -> None:
        self.words[index] = int(value) & 0xFFFFFFFF

    def f32(self, index: int, value: float) -> None:
        self.words[index] = struct.unpack("<I", struct.pack("<f", float(value)))[0]

    def i32(self, index: int, value: int) -> None:
        self.words[index] = int(value) & 0xFFFFFFFF

    def scalar(self, index: int, value: float, wgsl: str) -> None:
        if wgsl == "f32":
            self.f32(index, value)
        else:
            self.i32(index, int(value))

    def to_bytes(self) -> bytes:
        return struct.pack(f"<{PARAM_WORDS}I", *self.words)


# WGSL every kernel starts with: the uniform parameters and their readers.
PARAMS_WGSL = f"""
struct Params {{ v: array<vec4<u32>, {PARAM_WORDS // 4}> }};
@group(0) @binding(0) var<uniform> params: Params;
fn u(i: u32) -> u32 {{ return params.v[i / 4u][i % 4u]; }}
fn uf(i: u32) -> f32 {{ return bitcast<f32>(u(i)); }}
fn ui(i: u32) -> i32 {{ return bitcast<i32>(u(i)); }}
"""


def grid_1d(groups: int) -> tuple[int, int]:
    """(x, y) workgroup counts covering `groups` groups within the per-dimension limit."""
    groups = max(groups, 1)
    x = min(groups, MAX_GROUPS)
    return x, math.ceil(groups / x)


class Gpu:
    """The device, and the pipelines compiled so far (one per distinct WGSL source)."""

    def __init__(self, device: wgpu.GPUDevice) -> None:
        self.device = device
        self._pipelines: dict[str, wgpu.GPUComputePipeline] = {}

    def pipeline(self, code: str) -> wgpu.GPUComputePipeline:
        if code not in self._pipelines:
            module = self.device.create_shader_module(code=code)
            self._pipelines[code] = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": "main"}
            )
        return self._pipelines[code]

    def storage(self, nbytes: int) -> wgpu.GPUBuffer:
        # WebGPU binds no zero-sized buffer; 4-byte alignment for copies.
        size = max(4, (nbytes + 3) // 4 * 4)
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        return self.device.create_buffer(size=size, usage=usage)


class Dispatch:
    """One compute dispatch: its pipeline, bind group (uniforms + tensors) and uniform buffer."""

    def __init__(self, gpu: Gpu, code: str, tensors: Sequence[GpuTensor]) -> None:
        self.gpu = gpu
        self.pipeline = gpu.pipeline(code)
        self.uniforms = gpu.device.create_buffer(
            size=PARAM_WORDS * 4,
            usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST,
        )
        entries = [{"binding": 0, "resource": {"buffer": self.uniforms}}]
        entries += [
            {"binding": i + 1, "resource": {"buffer": tensor.buffer}}
            for i, tensor in enumerate(tensors)
        ]
        self.bind_group = gpu.device.create_bind_group(
            layout=self.pipeline.get_bind_group_layout(0), entries=entries
        )
        # The parameters last written: a run at the same shapes writes none again.
        self.written: bytes | None = None

    def record(
        self, compute_pass: wgpu.GPUComputePassEncoder, params: Params, grid: Sequence[int]
    ) -> None:
        if math.prod(grid) == 0:
            return
        data = params.to_bytes()
        if data != self.written:
            self.gpu.device.queue.write_buffer(self.uniforms, 0, data)
            self.written = data
        compute_pass.set_pipeline(self.pipeline)
        compute_pass.set_bind_group(0, self.bind_group)
        compute_pass.dispatch_workgroups(*grid)


class GpuOp:
    """A delegated op. Subclasses set `outputs` in __init__, and implement resize and encode."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        self.gpu = gpu
        self.name = name
        self.args = list(args)

    def resize(self) -> None:
        raise NotImplementedError

    def encode(self, compute_pass: wgpu.GPUComputePassEncoder) -> None:
        raise NotImplementedError


def tensor_arg(op: str, value: Any, position: str) -> GpuTensor:
    if not isinstance(value, GpuTensor):
        raise UnsupportedOp(f"{op}: its {position} is {type(value).__name__}, not a tensor")
    return value
