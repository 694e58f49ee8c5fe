"""Which buffer each tensor of a delegate lives in, planned here rather than taken from the
payload's memory planning, so that views and copies need no dispatch.

A view of a contiguous tensor, or a copy to the same GPU element type, has the same elements in
the same order as its input: its output is given its input's buffer, and the op only sets live
dims. Tensors sharing a buffer this way form a group that lives from its first write to the last
read of any of them. Groups then get buffers greedily in order of their first write: a buffer is
reused once every group in it has been read for the last time by an earlier op, so no op ever
reads and writes one buffer. Constants keep the buffers their bytes were uploaded to.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import wgpu

from runtimes.loaders.webgpu.kernels.base import Gpu, GpuTensor
from runtimes.loaders.webgpu.kernels.elementwise import COPIES
from runtimes.loaders.webgpu.kernels.layout import VIEWS


def _tensors(value: Any) -> Iterator[GpuTensor]:
    if isinstance(value, GpuTensor):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _tensors(item)


def _same_values(name: str, source: GpuTensor, out: GpuTensor) -> bool:
    if name in VIEWS:
        return True
    # A bool output of a number is whether it is nonzero: a conversion, not the same words.
    return (
        name in COPIES
        and source.wgsl == out.wgsl
        and (source.host_dtype == "bool") == (out.host_dtype == "bool")
    )


def _nbytes(tensor: GpuTensor) -> int:
    return math.prod(tensor.max_dims) * 4


def plan(
    gpu: Gpu,
    calls: Sequence[tuple[str, Sequence[Any]]],
    tensors: Sequence[GpuTensor],
    outputs: Sequence[Any],
) -> set[int]:
    """Sets the buffer of every tensor of `tensors` whose buffer is None (all but constants),
    before any bind group is made; returns the positions of the calls whose output now shares
    its input's buffer.

    `calls`: the delegate's ops in order, each its name and resolved arguments, the output last;
    `outputs`: the delegate's output values, read after the last op."""
    aliased: set[int] = set()
    groups: dict[int, list[GpuTensor]] = {}
    for k, (name, args) in enumerate(calls):
        if not args or not isinstance(args[0], GpuTensor) or not isinstance(args[-1], GpuTensor):
            continue
        source, out = args[0], args[-1]
        if out.buffer is not None or not _same_values(name, source, out):
            continue
        aliased.add(k)
        if source.buffer is not None:
            # A view of a constant: nothing ever writes either of them.
            out.buffer = source.buffer
            continue
        group = groups.setdefault(id(source), [source])
        group.append(out)
        groups[id(out)] = group

    start: dict[int, int] = {}
    stop: dict[int, int] = {}
    for k, (_, args) in enumerate(calls):
        if k in aliased:
            continue
        for tensor in _tensors(args[-1]):
            start.setdefault(id(tensor), k)
        for tensor in _tensors(list(args[:-1])):
            stop[id(tensor)] = k
    for tensor in _tensors(list(outputs)):
        stop[id(tensor)] = len(calls)

    planned: list[tuple[int, int, int, list[GpuTensor]]] = []
    seen: set[int] = set()
    for tensor in tensors:
        if tensor.buffer is not None or id(tensor) in seen:
            continue
        group = groups.get(id(tensor), [tensor])
        seen.update(id(t) for t in group)
        # Delegate inputs (never written by an op) are written before the first op.
        first = min(start.get(id(t), -1) for t in group)
        last = max(max(stop.get(id(t), -1) for t in group), first)
        planned.append((first, last, max(_nbytes(t) for t in group), group))

    free: list[wgpu.GPUBuffer] = []
    busy: list[tuple[int, wgpu.GPUBuffer]] = []
    for first, last, nbytes, group in sorted(planned, key=lambda p: p[0]):
        free += [buffer for until, buffer in busy if until < first]
        busy = [(until, buffer) for until, buffer in busy if until >= first]
        fitting = [buffer for buffer in free if buffer.size >= nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.size)
            free.remove(buffer)
        else:
            buffer = gpu.storage(nbytes)
        busy.append((last, buffer))
        for tensor in group:
            tensor.buffer = buffer
    return aliased
