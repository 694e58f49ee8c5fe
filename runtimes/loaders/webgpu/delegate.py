"""One VulkanBackend delegate on a WebGPU device: its values, buffers and ops, and `execute`.

At load: constants are uploaded once, every other tensor gets a storage buffer sized at its
upper-bound dims (shared with others as runtimes/loaders/webgpu/memory_plan.py plans, views and
same-type copies sharing their input's), and every op builds its pipelines and bind groups.

An execute writes the live inputs and, the first time it meets these live shapes, runs each op's
resize rule in graph order and records the dispatches and their parameters
(kernels.base.Recording); at shapes met before, it replays what it recorded then. It submits one
compute pass and reads the outputs back at their live shapes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import wgpu

from runtimes.formats.vulkan_payload import (
    NAMED_DATA_OFFSET,
    BoolList,
    DoubleList,
    IntList,
    ValueList,
    VkGraph,
    VkTensor,
)
from runtimes.formats.vulkan_payload import SymInt as VkSymInt
from runtimes.loaders.webgpu import kernels, memory_plan
from runtimes.loaders.webgpu.kernels.base import (
    Gpu,
    GpuOp,
    GpuTensor,
    Recording,
    SymInt,
    UnsupportedOp,
    copy_buffers,
)
from runtimes.loaders.webgpu.kernels.layout import Reinterpret

# GPU element type per serialized dtype: ints are int32 on the GPU (the serializer downcasts
# int64), bools are stored one per 32-bit word.
_WGSL = {"float32": "f32", "int32": "i32", "int64": "i32", "bool": "i32"}
_NUMPY = {"f32": np.float32, "i32": np.int32}
# Offsets into a mapped buffer must be multiples of 8; 256 keeps each output's copy aligned too.
_MAP_ALIGNMENT = 256
# Ops that only repack a constant for the native runtime's texture layouts; here the constant's
# buffer already is the packed form, so their output is that buffer.
ALIASES = ("et_vk.prepack.default",)
# Live-shape sets whose recordings a delegate keeps (the least recently used goes first).
RECORDINGS_KEPT = 64


@dataclass
class ShapeRecording:
    """What an execute at one set of live shapes does: its dispatches and their parameter
    uploads; the copies of the live inputs from the inbox to their buffers and of the outputs
    to staging (copy_buffers' tuples); how many bytes of staging the outputs fill; and the
    outputs' live dims (a tensor's) or values (a symbolic int's)."""

    recording: Recording
    uploads: list[tuple[wgpu.GPUBuffer, int, bytes]]
    copies_in: list[tuple[Any, ...]]
    copies_out: list[tuple[Any, ...]]
    staged: int
    outputs: list[tuple[Any, list[int] | int]]


class DelegateGraph:
    def __init__(self, gpu: Gpu, graph: VkGraph, named_data: Mapping[str, bytes]) -> None:
        self.gpu = gpu
        self.values: list[Any] = self._values(graph, named_data)
        calls = []
        for call in graph.chain:
            if call.name in ALIASES:
                self.values[call.args[-1]] = self.values[call.args[0]]
                continue
            calls.append((call.name, [self.values[a] for a in call.args]))
        tensors = [v for v in self.values if isinstance(v, GpuTensor)]
        outputs = [self.values[v] for v in graph.output_ids]
        aliased = memory_plan.plan(gpu, calls, tensors, outputs)
        self.ops: list[GpuOp] = [
            Reinterpret(gpu, name, args) if k in aliased else kernels.build(gpu, name, args)
            for k, (name, args) in enumerate(calls)
        ]
        self.input_ids = graph.input_ids
        self.output_ids = graph.output_ids
        # Where the live inputs are written, packed, in one upload per execute; the command
        # buffer copies each to its own buffer.
        inputs = [self.values[v] for v in self.input_ids]
        inbox_size = sum(math.prod(t.max_dims) * 4 for t in inputs if isinstance(t, GpuTensor))
        self.inbox = gpu.device.create_buffer(
            size=max(4, inbox_size),
            usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST,
        )
        # Where outputs are copied to be read on the host: one mappable buffer for all of
        # them, each at its own offset, sized at its upper bound like the tensor itself; one
        # map per execute.
        self.staging_offsets: dict[int, int] = {}
        size = 0
        for value_id in self.output_ids:
            if isinstance(self.values[value_id], GpuTensor):
                self.staging_offsets[value_id] = size
                size += -(-self.values[value_id].buffer.size // _MAP_ALIGNMENT) * _MAP_ALIGNMENT
        self.staging = gpu.device.create_buffer(
            size=max(size, _MAP_ALIGNMENT),
            usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
        )
        self.recordings: OrderedDict[tuple[Any, ...], ShapeRecording] = OrderedDict()
        # The recording whose parameters the uniform buffers hold now.
        self.uploaded: ShapeRecording | None = None

    def _values(self, graph: VkGraph, named_data: Mapping[str, bytes]) -> list[Any]:
        values: list[Any] = []
        for value in graph.values:
            if isinstance(value, VkTensor):
                values.append(self._tensor(value, graph, named_data))
            elif isinstance(value, VkSymInt):
                values.append(SymInt(value.value))
            elif isinstance(value, IntList | DoubleList | BoolList):
                values.append(list(value.items))
            else:
                values.append(value)
        # Lists of values refer to the objects above: a symbolic int in a size list is the
        # same cell an op updates.
        for index, value in enumerate(graph.values):
            if isinstance(value, ValueList):
                values[index] = [values[v] for v in value.value_ids]
        return values

    def _tensor(
        self, value: VkTensor, graph: VkGraph, named_data: Mapping[str, bytes]
    ) -> GpuTensor:
        """A constant in its own buffer, with its bytes; any other tensor without a buffer
        yet (the memory plan gives it one)."""
        if value.dtype not in _WGSL:
            raise UnsupportedOp(f"a {value.dtype} tensor (supported: {', '.join(_WGSL)})")
        wgsl = _WGSL[value.dtype]
        if value.constant_id < 0:
            return GpuTensor(wgsl, value.dtype, tuple(value.dims), None)
        tensor = GpuTensor(wgsl, value.dtype, tuple(value.dims), self.gpu.storage(_nbytes(value)))
        constant = graph.constants[value.constant_id]
        if constant.offset == NAMED_DATA_OFFSET or constant.named_key:
            data = named_data[str(constant.named_key)][: constant.length]
        else:
            data = graph.constant_bytes[constant.offset : constant.offset + constant.length]
        host = np.frombuffer(data, dtype=_host_numpy(value.dtype))
        self._upload(tensor, host.astype(_NUMPY[wgsl]))
        return tensor

    def _upload(self, tensor: GpuTensor, array: np.ndarray) -> None:
        if array.size:
            self.gpu.device.queue.write_buffer(tensor.buffer, 0, np.ascontiguousarray(array))

    def execute(self, inputs: Sequence[torch.Tensor | int]) -> list[torch.Tensor | int]:
        shapes, arrays = self._live_inputs(inputs)
        recorded = self.recordings.get(shapes)
        if recorded is None:
            recorded = self._record()
            self.recordings[shapes] = recorded
            if len(self.recordings) > RECORDINGS_KEPT:
                self.recordings.popitem(last=False)
        else:
            self.recordings.move_to_end(shapes)
            for value, live in recorded.outputs:
                if isinstance(value, SymInt):
                    value.value = live
                else:
                    value.dims = live
        queue = self.gpu.device.queue
        if self.uploaded is not recorded:
            for buffer, offset, data in recorded.uploads:
                queue.write_buffer(buffer, offset, data)
            self.uploaded = recorded
        packed = b"".join(arrays)
        if packed:
            queue.write_buffer(self.inbox, 0, packed)
        encoder = self.gpu.device.create_command_encoder()
        copy_buffers(encoder, recorded.copies_in)
        compute_pass = encoder.begin_compute_pass()
        recorded.recording.encode(compute_pass)
        compute_pass.end()
        copy_buffers(encoder, recorded.copies_out)
        queue.submit([encoder.finish()])
        # Mapping waits for the submitted work: the outputs are final once it returns.
        self.staging.map_sync(wgpu.MapMode.READ)
        try:
            staged = self.staging.read_mapped(0, recorded.staged, copy=False)
            return [self._read(value_id, staged) for value_id in self.output_ids]
        finally:
            self.staging.unmap()

    def _live_inputs(
        self, inputs: Sequence[torch.Tensor | int]
    ) -> tuple[tuple[Any, ...], list[np.ndarray]]:
        """Sets the live dims and ints of the delegate's inputs; returns them, which decide every
        op's live shapes and parameters, and the tensors' data in GPU element types."""
        shapes: list[Any] = []
        arrays = []
        for position, (value_id, given) in enumerate(zip(self.input_ids, inputs, strict=True)):
            target = self.values[value_id]
            if isinstance(target, SymInt):
                target.value = int(given)
                shapes.append(target.value)
                continue
            _check_bound(position, target, given.shape)
            target.dims = list(given.shape)
            shapes.append(tuple(target.dims))
            array = given.detach().contiguous().numpy()
            if array.dtype != _NUMPY[target.wgsl]:
                array = array.astype(_NUMPY[target.wgsl])
            arrays.append(array)
        return tuple(shapes), arrays

    def _record(self) -> ShapeRecording:
        for op in self.ops:
            op.resize()
        recording = Recording()
        for op in self.ops:
            op.encode(recording)
        copies_in = []
        offset = 0
        for value_id in self.input_ids:
            tensor = self.values[value_id]
            if isinstance(tensor, GpuTensor) and tensor.numel:
                nbytes = tensor.numel * 4
                copies_in.append((self.inbox._internal, offset, tensor.buffer._internal, 0, nbytes))
                offset += nbytes
        copies_out = []
        staged = 0
        for value_id, offset in self.staging_offsets.items():
            tensor = self.values[value_id]
            if tensor.numel:
                nbytes = tensor.numel * 4
                copies_out.append(
                    (tensor.buffer._internal, 0, self.staging._internal, offset, nbytes)
                )
                staged = offset + nbytes
        outputs = []
        for value_id in self.output_ids:
            value = self.values[value_id]
            outputs.append((value, value.value if isinstance(value, SymInt) else list(value.dims)))
        return ShapeRecording(
            recording, recording.uploads(), copies_in, copies_out, staged, outputs
        )

    def _read(self, value_id: int, staged: memoryview) -> torch.Tensor | int:
        """An output, copied out of `staged`, the mapped staging buffer."""
        value = self.values[value_id]
        if isinstance(value, SymInt):
            return value.value
        dtype = _NUMPY[value.wgsl]
        if not value.numel:
            return torch.from_numpy(np.zeros(value.dims, dtype=dtype))
        offset = self.staging_offsets[value_id]
        array = np.frombuffer(staged, dtype=dtype, count=value.numel, offset=offset)
        return torch.from_numpy(array.reshape(value.dims).copy())


def _nbytes(value: VkTensor) -> int:
    return math.prod(value.dims) * 4


def _host_numpy(dtype: str) -> type:
    return {"float32": np.float32, "int32": np.int32, "int64": np.int64, "bool": np.bool_}[dtype]


def _check_bound(position: int, tensor: GpuTensor, shape: Sequence[int]) -> None:
    if len(shape) != tensor.rank or any(
        live > bound for live, bound in zip(shape, tensor.max_dims, strict=True)
    ):
        raise ValueError(
            f"delegate input {position} has shape {list(shape)}; its buffers were planned for "
            f"at most {list(tensor.max_dims)} (rank {tensor.rank})"
        )
