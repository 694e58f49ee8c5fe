"""What every delegated op is built from: tensors in GPU buffers sized at their upper bound, and
dispatches (a WGSL pipeline, its bind group and its uniform parameters) recorded into one pass.

An op is built once, at load, from its resolved arguments. At a new set of live shapes, the
delegate calls each op's `resize` (the op's resize rule: live output dims from live input dims
and symbolic ints), then `encode`, which adds the op's dispatches and their live parameters to a
Recording; the delegate keeps the Recording and replays it while the shapes stay the same.
Buffers and bind groups never change after load.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import wgpu

# wgpu-native's C functions, which wgpu-py's pass methods wrap (wgpu is pinned below 0.33): a
# replay calls them directly. wgpu-core checks a pass's commands when the pass ends, which the
# caller does through wgpu-py, so its errors are still raised there.
from wgpu.backends.wgpu_native._ffi import ffi, lib

# The most dims any kernel indexes; lower-rank tensors are padded with leading 1s.
MAX_RANK = 6
# 48 u32 words of uniform parameters per dispatch (12 vec4, as uniform arrays need).
PARAM_WORDS = 48
# Each dispatch's parameters sit at their own offset of a shared uniform buffer; bindings must
# start at multiples of WebGPU's default minUniformBufferOffsetAlignment.
PARAM_STRIDE = 256
PARAM_SLOTS_PER_BUFFER = 256
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
    """A contiguous tensor in a storage buffer, which it may share with tensors not alive at
    the same time, or with its views (runtimes/loaders/webgpu/memory_plan.py)."""

    # WGSL element type: f32 for float32, i32 for int32, int64 (downcast) and bool.
    wgsl: str
    # The tensor's dtype on the host side ("float32", "int32", "int64", "bool").
    host_dtype: str
    max_dims: tuple[int, ...]
    # None only while a delegate loads, until its memory plan gives the tensor one.
    buffer: wgpu.GPUBuffer | None
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
    """The device, the pipelines compiled so far (one per distinct WGSL source), and the uniform
    buffers that hold every dispatch's parameters, PARAM_STRIDE bytes apart."""

    def __init__(self, device: wgpu.GPUDevice) -> None:
        self.device = device
        self._pipelines: dict[str, wgpu.GPUComputePipeline] = {}
        self._uniforms: list[wgpu.GPUBuffer] = []
        self._slots_used = PARAM_SLOTS_PER_BUFFER

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

    def uniform_slot(self) -> tuple[wgpu.GPUBuffer, int]:
        """A new dispatch's place for its parameters: (uniform buffer, byte offset). Slots are
        handed out in order, so the dispatches of one delegate, built together, fill one run
        of slots per buffer and a Recording writes each run in one upload."""
        if self._slots_used == PARAM_SLOTS_PER_BUFFER:
            self._uniforms.append(
                self.device.create_buffer(
                    size=PARAM_STRIDE * PARAM_SLOTS_PER_BUFFER,
                    usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST,
                )
            )
            self._slots_used = 0
        offset = self._slots_used * PARAM_STRIDE
        self._slots_used += 1
        return self._uniforms[-1], offset


class Dispatch:
    """One compute dispatch: its pipeline, and its bind group (its uniform slot + tensors)."""

    def __init__(self, gpu: Gpu, code: str, tensors: Sequence[GpuTensor]) -> None:
        self.pipeline = gpu.pipeline(code)
        self.uniforms, self.offset = gpu.uniform_slot()
        entries = [
            {
                "binding": 0,
                "resource": {
                    "buffer": self.uniforms,
                    "offset": self.offset,
                    "size": PARAM_WORDS * 4,
                },
            }
        ]
        entries += [
            {"binding": i + 1, "resource": {"buffer": tensor.buffer}}
            for i, tensor in enumerate(tensors)
        ]
        self.bind_group = gpu.device.create_bind_group(
            layout=self.pipeline.get_bind_group_layout(0), entries=entries
        )

    def record(self, recording: Recording, params: Params, grid: Sequence[int]) -> None:
        if math.prod(grid) != 0:
            recording.add(self, params.to_bytes(), grid)


class Recording:
    """The dispatches of a delegate at one set of live shapes, and the parameters of them all as
    one upload per uniform buffer. Replaying it costs three C calls per dispatch (set pipeline,
    only where it changes; set bind group; dispatch) and no Python work per op."""

    def __init__(self) -> None:
        # Per dispatch: its pipeline's handle (None where the previous dispatch's is the same),
        # its bind group's handle and its grid.
        self.commands: list[tuple[Any, Any, int, int, int]] = []
        # Their wgpu-py objects, which own the handles.
        self._owners: list[Dispatch] = []
        self._params: dict[wgpu.GPUBuffer, dict[int, bytes]] = {}
        self._last_pipeline: wgpu.GPUComputePipeline | None = None

    def add(self, dispatch: Dispatch, params: bytes, grid: Sequence[int]) -> None:
        pipeline = dispatch.pipeline
        handle = None if pipeline is self._last_pipeline else pipeline._internal
        self._last_pipeline = pipeline
        x, y, z = grid
        self.commands.append((handle, dispatch.bind_group._internal, x, y, z))
        self._owners.append(dispatch)
        self._params.setdefault(dispatch.uniforms, {})[dispatch.offset] = params

    def uploads(self) -> list[tuple[wgpu.GPUBuffer, int, bytes]]:
        """(buffer, offset, bytes): every recorded parameter, one contiguous write per buffer.
        The gaps between slots are slots of this delegate's dispatches that dispatch nothing at
        these shapes, so writing zeros there harms no one."""
        uploads = []
        for buffer, slots in self._params.items():
            start = min(slots)
            blob = bytearray(max(slots) + PARAM_STRIDE - start)
            for offset, data in slots.items():
                blob[offset - start : offset - start + len(data)] = data
            uploads.append((buffer, start, bytes(blob)))
        return uploads

    def encode(self, compute_pass: wgpu.GPUComputePassEncoder) -> None:
        encoder = compute_pass._internal
        set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
        no_offsets = ffi.NULL
        for pipeline, bind_group, x, y, z in self.commands:
            if pipeline is not None:
                set_pipeline(encoder, pipeline)
            set_bind_group(encoder, 0, bind_group, 0, no_offsets)
            dispatch(encoder, x, y, z)


def copy_buffers(encoder: wgpu.GPUCommandEncoder, copies: Sequence[tuple[Any, ...]]) -> None:
    """Records buffer-to-buffer copies, each (source handle, offset, destination handle,
    offset, bytes) of buffers' `_internal`; wgpu-core checks them when the encoder finishes."""
    handle = encoder._internal
    copy = lib.wgpuCommandEncoderCopyBufferToBuffer
    for source, source_offset, destination, destination_offset, nbytes in copies:
        copy(handle, source, source_offset, destination, destination_offset, nbytes)


class GpuOp:
    """A delegated op. Subclasses set `outputs` in __init__, and implement resize and encode."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        self.gpu = gpu
        self.name = name
        self.args = list(args)

    def resize(self) -> None:
        raise NotImplementedError

    def encode(self, recording: Recording) -> None:
        raise NotImplementedError


def tensor_arg(op: str, value: Any, position: str) -> GpuTensor:
    if not isinstance(value, GpuTensor):
        raise UnsupportedOp(f"{op}: its {position} is {type(value).__name__}, not a tensor")
    return value
