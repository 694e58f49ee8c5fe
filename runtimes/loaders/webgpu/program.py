"""Runs a .pte whose delegates are VulkanBackend payloads: the program's instructions in order,
CPU kernels through PyTorch, each delegate call on the WebGPU device.

Every op this runtime cannot run, on the CPU or the GPU, is refused when the program loads,
and every input is checked against the upper bound the program was planned for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtimes.formats.pte_file import (
    DelegateCall,
    ExecutionPlan,
    FreeCall,
    IntList,
    JumpFalseCall,
    KernelCall,
    MoveCall,
    OptionalTensorList,
    TensorList,
    TensorValue,
    read_pte,
)
from runtimes.formats.vulkan_payload import VkGraph, read_vulkan_payload
from runtimes.loaders.webgpu import adapter, kernels
from runtimes.loaders.webgpu.cpu_kernels import CpuKernel, resolve
from runtimes.loaders.webgpu.delegate import ALIASES, DelegateGraph
from runtimes.loaders.webgpu.kernels.base import Gpu, UnsupportedOp

BACKEND_ID = "VulkanBackend"


class InputOutOfBounds(ValueError):
    pass


class WebgpuProgram:
    """A loaded program; `run` may be called with inputs of any shape within its bounds, and is
    `download(execute(upload(inputs)))`, the steps a benchmark times apart (runtimes.Loaded).

    `execute` walks the whole program: its CPU kernels and, per delegate call, the copy of that
    delegate's inputs to the GPU, its compute pass, and the copy of its outputs back, which the
    CPU kernels after it read. It returns once the GPU has finished, so a host clock times it."""

    clock = "cpu"

    def __init__(self, path: Path, device: str = "auto", method: str = "forward") -> None:
        pte = read_pte(path)
        plans = {plan.name: plan for plan in pte.plans}
        if method not in plans:
            raise ValueError(f"{path}: no method {method!r}; it has {', '.join(plans)}")
        self.plan: ExecutionPlan = plans[method]
        graphs = [
            read_vulkan_payload(d.payload)
            for d in self.plan.delegates
            if d.backend_id == BACKEND_ID
        ]
        refused = self._refused_ops(graphs)
        if refused:
            raise UnsupportedOp(
                f"{path}: this runtime cannot run {'; '.join(refused)}; nothing was run"
            )
        chosen = adapter.choose(device)
        self.adapter = adapter.info(chosen)
        self.target = {
            "adapter": self.adapter.name,
            "adapter_backend": self.adapter.backend,
            "adapter_type": self.adapter.kind,
        }
        limits = chosen.limits
        gpu = Gpu(
            chosen.request_device_sync(
                required_limits={
                    "max-storage-buffer-binding-size": limits["max-storage-buffer-binding-size"],
                    "max-buffer-size": limits["max-buffer-size"],
                }
            )
        )
        self.delegates = [DelegateGraph(gpu, graph, pte.named_data) for graph in graphs]
        self.kernels: list[CpuKernel] = [
            resolve(op.name, op.overload) for op in self.plan.operators
        ]
        self.values: list[Any] = [_initial(value) for value in self.plan.values]

    def _refused_ops(self, graphs: Sequence[VkGraph]) -> list[str]:
        """Everything in the program this runtime has no kernel for, found before any work."""
        refused = []
        for delegate in self.plan.delegates:
            if delegate.backend_id != BACKEND_ID:
                refused.append(f"a {delegate.backend_id} delegate (only {BACKEND_ID})")
        gpu_ops = {call.name for graph in graphs for call in graph.chain}
        missing = sorted(gpu_ops - set(kernels.BUILDERS) - set(ALIASES))
        if missing:
            refused.append(
                f"GPU op(s) {', '.join(missing)}: no kernel for them in "
                "runtimes/loaders/webgpu/kernels (lower with the exporter's backend=webgpu, "
                "which keeps such ops off the delegates)"
            )
        for op in self.plan.operators:
            try:
                resolve(op.name, op.overload)
            except UnsupportedOp as error:
                refused.append(f"CPU op {error}")
        return refused

    def upload(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | Any]:
        """The inputs checked against the program's bounds, at the dtypes it was planned with.
        They stay on the host: the walk copies each delegate's inputs to the GPU as it calls
        it, after the CPU kernels before it."""
        if len(inputs) != len(self.plan.inputs):
            raise InputOutOfBounds(
                f"the program takes {len(self.plan.inputs)} inputs, not {len(inputs)}"
            )
        resident = []
        for position, (index, given) in enumerate(zip(self.plan.inputs, inputs, strict=True)):
            planned = self.plan.values[index]
            if isinstance(planned, TensorValue):
                _check_input(position, planned, given)
                given = given.to(planned.dtype)
            resident.append(given)
        return resident

    def execute(self, resident: Sequence[torch.Tensor | Any]) -> list[Any]:
        for index, given in zip(self.plan.inputs, resident, strict=True):
            self.values[index] = given
        # The CPU kernels between delegates are glue on small tensors (masks, gathers, scalar
        # math): split over torch's thread pool, an idle pool's wake-up costs more than the
        # work (on the H100 machine's 16 cores, `any` over 4x99x99 took ms where 4x65x65, under
        # torch's grain size, took 0.1 ms).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._walk()
        finally:
            torch.set_num_threads(threads)
        return [self.values[index] for index in self.plan.outputs]

    def download(self, produced: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        # The next execute writes into the program's values: the caller gets its own copies.
        return tuple(_owned(value) for value in produced)

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self.download(self.execute(self.upload(inputs)))

    def _walk(self) -> None:
        instructions = self.plan.instructions
        pc = 0
        while pc < len(instructions):
            instruction = instructions[pc]
            pc += 1
            if isinstance(instruction, KernelCall):
                self._call_kernel(instruction)
            elif isinstance(instruction, DelegateCall):
                self._call_delegate(instruction)
            elif isinstance(instruction, MoveCall):
                self.values[instruction.move_to] = self.values[instruction.move_from]
            elif isinstance(instruction, JumpFalseCall):
                if not self.values[instruction.cond_value_index]:
                    pc = instruction.destination_instruction
            elif isinstance(instruction, FreeCall):
                continue

    def _argument(self, index: int) -> Any:
        value = self.plan.values[index]
        if isinstance(value, IntList):
            return [self.values[i] for i in value.value_indices]
        if isinstance(value, TensorList):
            return [self.values[i] for i in value.value_indices]
        if isinstance(value, OptionalTensorList):
            return [None if i < 0 else self.values[i] for i in value.value_indices]
        return self.values[index]

    def _call_kernel(self, call: KernelCall) -> None:
        kernel = self.kernels[call.op_index]
        args = [self._argument(index) for index in call.args]
        results = kernel(args)
        for index, result in zip(call.args[len(call.args) - len(results) :], results, strict=True):
            self.values[index] = result

    def _call_delegate(self, call: DelegateCall) -> None:
        delegate = self.delegates[call.delegate_index]
        count = len(delegate.input_ids)
        inputs = []
        for index in call.args[:count]:
            value = self.values[index]
            if isinstance(value, torch.Tensor):
                # The GPU holds float32 or int32 (ints, and bools as 0 or 1).
                value = value.to(torch.float32 if value.is_floating_point() else torch.int32)
            inputs.append(value)
        outputs = delegate.execute(inputs)
        for index, output in zip(call.args[count:], outputs, strict=True):
            planned = self.plan.values[index]
            if isinstance(planned, TensorValue) and isinstance(output, torch.Tensor):
                output = output.to(planned.dtype)
            self.values[index] = output


def _initial(value: Any) -> Any:
    """A value's state before the first run: constants as tensors, planned tensors zeros.

    A mutable buffer without an initial state in the program (a KV cache) is a planned tensor
    too: it starts at zero, as transformers' cache does, since its unwritten slots are read
    (with zero attention weight, which would not cancel a NaN that uninitialized memory can
    hold). Its value then persists from run to run, as the program writes it back after each."""
    if isinstance(value, TensorValue):
        if value.constant is not None:
            flat = torch.frombuffer(bytearray(value.constant), dtype=value.dtype)
            return flat.reshape(value.sizes)
        return torch.zeros(value.sizes, dtype=value.dtype)
    return value


def _check_input(position: int, planned: TensorValue, given: torch.Tensor) -> None:
    bound = list(planned.sizes)
    shape = list(given.shape)
    if len(shape) != len(bound):
        raise InputOutOfBounds(
            f"input {position} has rank {len(shape)} ({shape}); the program takes rank "
            f"{len(bound)} ({bound} at most)"
        )
    over = [d for d, (size, top) in enumerate(zip(shape, bound, strict=True)) if size > top]
    if planned.shape_dynamism == 0 and shape != bound:
        raise InputOutOfBounds(
            f"input {position} has shape {shape}; the program was exported with it static at "
            f"{bound}"
        )
    if over:
        raise InputOutOfBounds(
            f"input {position} has shape {shape}: dim {over[0]} is {shape[over[0]]}, above its "
            f"upper bound {bound[over[0]]}; the program was planned for at most {bound}"
        )


def _owned(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
