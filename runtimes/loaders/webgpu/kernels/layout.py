"""Data movement: views, permutes, expands, slices, selects and cats.

Every tensor here is contiguous in its own buffer, so each of these ops is one strided copy
(cat: one per input) whose resize rule is the op's shape rule, and whose strides and offset say
which input element lands where.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from runtimes.loaders.webgpu.kernels.base import (
    Gpu,
    GpuOp,
    GpuTensor,
    Recording,
    contiguous_strides,
    live,
    tensor_arg,
)
from runtimes.loaders.webgpu.kernels.strided import Operand, StridedDispatch, kernel


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


class StridedCopy(GpuOp):
    """A copy of input 0 into the output, walked over the output's dims with `_source` strides."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.input = tensor_arg(name, args[0], "input")
        self.out = tensor_arg(name, args[-1], "output")
        code = kernel(self.out.wgsl, [self.input.wgsl], f"{self.out.wgsl}(in1[o1])")
        self.dispatch = StridedDispatch(gpu, code, [self.out, self.input])

    def out_dims(self) -> list[int]:
        raise NotImplementedError

    def source(self) -> Operand:
        """Where output element (multi-index over out dims) is read from in the input."""
        raise NotImplementedError

    def resize(self) -> None:
        self.out.set_dims(self.out_dims(), self.name)

    def encode(self, recording: Recording) -> None:
        dims = self.out.dims
        operands = [Operand(0, contiguous_strides(dims)), self.source()]
        self.dispatch.record(recording, dims, operands)


def view_dims(name: str, args: Sequence[Any], input: GpuTensor) -> list[int]:
    """The live dims of a view_copy, unsqueeze_copy or squeeze_copy of `input`."""
    dims = input.dims
    if name == "aten.view_copy.default" or name == "aten._unsafe_view.default":
        size = live(args[1])
        if -1 in size:
            known = math.prod(s for s in size if s != -1)
            size[size.index(-1)] = input.numel // known if known else 0
        return size
    if name == "aten.unsqueeze_copy.default":
        dim = _dim(args[1], len(dims) + 1)
        return [*dims[:dim], 1, *dims[dim:]]
    squeezed = args[1] if len(args) > 2 else None
    if squeezed is None:
        targets = set(range(len(dims)))
    elif isinstance(squeezed, list):
        targets = {_dim(d, len(dims)) for d in squeezed}
    else:
        targets = {_dim(squeezed, len(dims))}
    return [size for d, size in enumerate(dims) if not (d in targets and size == 1)]


class View(StridedCopy):
    """view_copy, unsqueeze_copy, squeeze_copy: same elements in the same order."""

    def out_dims(self) -> list[int]:
        return view_dims(self.name, self.args, self.input)

    def source(self) -> Operand:
        return Operand(0, contiguous_strides(self.out.dims))


class Reinterpret(GpuOp):
    """A view, or a copy to the same GPU element type, whose output was given its input's
    buffer at load (runtimes/loaders/webgpu/aliasing.py): it only sets the output's live dims."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.input = tensor_arg(name, args[0], "input")
        self.out = tensor_arg(name, args[-1], "output")

    def resize(self) -> None:
        if self.name in VIEWS:
            self.out.set_dims(view_dims(self.name, self.args, self.input), self.name)
        else:
            self.out.set_dims(self.input.dims, self.name)

    def encode(self, recording: Recording) -> None:
        return


class Permute(StridedCopy):
    def out_dims(self) -> list[int]:
        return [self.input.dims[_dim(d, self.input.rank)] for d in self.args[1]]

    def source(self) -> Operand:
        strides = contiguous_strides(self.input.dims)
        return Operand(0, [strides[_dim(d, self.input.rank)] for d in self.args[1]])


class Expand(StridedCopy):
    def out_dims(self) -> list[int]:
        size = live(self.args[1])
        pad = len(size) - self.input.rank
        return [self.input.dims[d - pad] if s == -1 else s for d, s in enumerate(size)]

    def source(self) -> Operand:
        out_dims = self.out.dims
        pad = len(out_dims) - self.input.rank
        strides = contiguous_strides(self.input.dims)
        return Operand(
            0,
            [0] * pad
            + [
                0 if size == 1 and out_dims[pad + d] != 1 else strides[d]
                for d, size in enumerate(self.input.dims)
            ],
        )


class Slice(StridedCopy):
    """slice_copy.Tensor(self, dim, start, end, step), with Python's clamping of start/end."""

    def _range(self) -> tuple[int, int, int, int]:
        dim = _dim(self.args[1], self.input.rank)
        size = self.input.dims[dim]
        start, end, step = (live(a) for a in self.args[2:5])
        start = 0 if start is None else start
        end = size if end is None else end
        start = min(max(start + size if start < 0 else start, 0), size)
        end = min(max(end + size if end < 0 else end, 0), size)
        return dim, start, max(end, start), step

    def out_dims(self) -> list[int]:
        dim, start, end, step = self._range()
        dims = list(self.input.dims)
        dims[dim] = -(-(end - start) // step)
        return dims

    def source(self) -> Operand:
        dim, start, _, step = self._range()
        strides = contiguous_strides(self.input.dims)
        offset = start * strides[dim]
        strides[dim] *= step
        return Operand(offset, strides)


class Select(StridedCopy):
    """select_copy.int(self, dim, index): the output drops `dim`."""

    def _index(self) -> tuple[int, int]:
        dim = _dim(self.args[1], self.input.rank)
        index = live(self.args[2])
        return dim, index + self.input.dims[dim] if index < 0 else index

    def out_dims(self) -> list[int]:
        dim, _ = self._index()
        return [s for d, s in enumerate(self.input.dims) if d != dim]

    def source(self) -> Operand:
        dim, index = self._index()
        strides = contiguous_strides(self.input.dims)
        return Operand(index * strides[dim], [s for d, s in enumerate(strides) if d != dim])


class Cat(GpuOp):
    """cat(tensors, dim): each input copied into its part of the output, one dispatch each."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.out = tensor_arg(name, args[-1], "output")
        self.inputs: list[GpuTensor] = [
            tensor_arg(name, t, f"input {k}") for k, t in enumerate(args[0])
        ]
        self.dispatches = [
            StridedDispatch(
                gpu,
                kernel(self.out.wgsl, [t.wgsl], f"{self.out.wgsl}(in1[o1])"),
                [self.out, t],
            )
            for t in self.inputs
        ]

    def _dim(self) -> int:
        return _dim(self.args[1], self.out.rank)

    def resize(self) -> None:
        dim = self._dim()
        # cat skips empty 1-d inputs, as ATen does (a legacy rule).
        parts = [t for t in self.inputs if t.dims != [0]]
        dims = list(parts[0].dims)
        dims[dim] = sum(t.dims[dim] for t in parts)
        self.out.set_dims(dims, self.name)

    def encode(self, recording: Recording) -> None:
        dim = self._dim()
        out_strides = contiguous_strides(self.out.dims)
        offset = 0
        for tensor, dispatch in zip(self.inputs, self.dispatches, strict=True):
            if tensor.dims == [0]:
                continue
            operands = [
                Operand(offset * out_strides[dim], out_strides),
                Operand(0, contiguous_strides(tensor.dims)),
            ]
            dispatch.record(recording, tensor.dims, operands)
            offset += tensor.dims[dim]


VIEWS = (
    "aten.view_copy.default",
    "aten._unsafe_view.default",
    "aten.unsqueeze_copy.default",
    "aten.squeeze_copy.default",
    "aten.squeeze_copy.dim",
    "aten.squeeze_copy.dims",
)
_COPIES: dict[str, type[StridedCopy]] = {
    "aten.view_copy.default": View,
    "aten._unsafe_view.default": View,
    "aten.unsqueeze_copy.default": View,
    "aten.squeeze_copy.default": View,
    "aten.squeeze_copy.dim": View,
    "aten.squeeze_copy.dims": View,
    "aten.permute_copy.default": Permute,
    "aten.expand_copy.default": Expand,
    "aten.slice_copy.Tensor": Slice,
    "aten.select_copy.int": Select,
}


OPS: dict[str, type[GpuOp]] = {**_COPIES, "aten.cat.default": Cat}
