"""One VulkanBackend delegate on a WebGPU device: its values, buffers and ops, and `execute`.

At load: every tensor gets a storage buffer sized at its upper-bound dims (tensors of one
memory-planning slot share one, sized for the largest), constants are uploaded once, and every
op builds its pipelines and bind groups. An execute only writes the live inputs, runs each op's
resize rule in graph order, records the dispatches into one compute pass, and reads the outputs
back at their live shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import wgpu

from runtimes.webgpu import kernels
from runtimes.webgpu.kernels.base import Gpu, GpuOp, GpuTensor, SymInt, UnsupportedOp
from runtimes.webgpu.vulkan_payload import (
    NAMED_DATA_OFFSET,
    BoolList,
    DoubleList,
    IntList,
    ValueList,
    VkGraph,
    VkTensor,
)
from runtimes.webgpu.vulkan_payload import SymInt as VkSymInt

# GPU element type per serialized dtype: ints are int32 on the GPU (the serializer downcasts
# int64), bools are stored one per 32-bit word.
_WGSL = {"float32": "f32", "int32": "i32", "int64": "i32", "bool": "i32"}
_NUMPY = {"f32": np.float32, "i32": np.int32}
# Offsets into a mapped buffer must be multiples of 8; 256 keeps each output's copy aligned too.
_MAP_ALIGNMENT = 256
# Ops that only repack a constant for the native runtime's texture layouts; here the constant's
# buffer already is the packed form, so their output is that buffer.
ALIASES = ("et_vk.prepack.default",)


class DelegateGraph:
    def __init__(self, gpu: Gpu, graph: VkGraph, named_data: Mapping[str, bytes]) -> None:
        self.gpu = gpu
        self.values: list[Any] = self._values(graph, named_data)
        self.ops: list[GpuOp] = []
        for call in graph.chain:
            if call.name in ALIASES:
                self.values[call.args[-1]] = self.values[call.args[0]]
                continue
            self.ops.append(kernels.build(gpu, call.name, [self.values[a] for a in call.args]))
        self.input_ids = graph.input_ids
        self.output_ids = graph.output_ids
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

    def _values(self, graph: VkGraph, named_data: Mapping[str, bytes]) -> list[Any]:
        slot_bytes: dict[int, int] = {}
        for value in graph.values:
            if isinstance(value, VkTensor) and value.mem_obj_id >= 0:
                slot = value.mem_obj_id
                slot_bytes[slot] = max(slot_bytes.get(slot, 0), _nbytes(value))
        slots = {slot: self.gpu.storage(size) for slot, size in slot_bytes.items()}
        values: list[Any] = []
        for value in graph.values:
            if isinstance(value, VkTensor):
                values.append(self._tensor(value, graph, named_data, slots))
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
        self,
        value: VkTensor,
        graph: VkGraph,
        named_data: Mapping[str, bytes],
        slots: Mapping[int, wgpu.GPUBuffer],
    ) -> GpuTensor:
        if value.dtype not in _WGSL:
            raise UnsupportedOp(f"a {value.dtype} tensor (supported: {', '.join(_WGSL)})")
        wgsl = _WGSL[value.dtype]
        if value.mem_obj_id >= 0:
            buffer = slots[value.mem_obj_id]
        else:
            buffer = self.gpu.storage(_nbytes(value))
        tensor = GpuTensor(wgsl, value.dtype, tuple(value.dims), buffer)
        if value.constant_id >= 0:
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
        for position, (value_id, given) in enumerate(zip(self.input_ids, inputs, strict=True)):
            target = self.values[value_id]
            if isinstance(target, SymInt):
                target.value = int(given)
                continue
            _check_bound(position, target, given.shape)
            target.dims = list(given.shape)
            array = given.detach().cpu().contiguous().numpy().astype(_NUMPY[target.wgsl])
            self._upload(target, array)
        for op in self.ops:
            op.resize()
        encoder = self.gpu.device.create_command_encoder()
        compute_pass = encoder.begin_compute_pass()
        for op in self.ops:
            op.encode(compute_pass)
        compute_pass.end()
        for value_id, offset in self.staging_offsets.items():
            tensor = self.values[value_id]
            if tensor.numel:
                encoder.copy_buffer_to_buffer(
                    tensor.buffer, 0, self.staging, offset, tensor.numel * 4
                )
        self.gpu.device.queue.submit([encoder.finish()])
        # Mapping waits for the submitted work: the outputs are final once it returns.
        self.staging.map_sync(wgpu.MapMode.READ)
        try:
            return [self._read(value_id) for value_id in self.output_ids]
        finally:
            self.staging.unmap()

    def _read(self, value_id: int) -> torch.Tensor | int:
        value = self.values[value_id]
        if isinstance(value, SymInt):
            return value.value
        array = np.zeros(value.dims, dtype=_NUMPY[value.wgsl])
        if value.numel:
            data = self.staging.read_mapped(self.staging_offsets[value_id], value.numel * 4)
            array = np.frombuffer(data, dtype=array.dtype).reshape(value.dims)
        return torch.from_numpy(array.copy())


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
