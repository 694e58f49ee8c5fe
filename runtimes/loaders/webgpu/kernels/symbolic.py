"""Ops on sizes, not data: they set a symbolic int during resize and dispatch nothing."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from runtimes.loaders.webgpu.kernels.base import (
    Gpu,
    GpuOp,
    Recording,
    SymInt,
    UnsupportedOp,
    live,
    tensor_arg,
)

_ARITHMETIC: dict[str, Callable[[int, int], int]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
}


class SymbolOp(GpuOp):
    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        if not isinstance(args[-1], SymInt):
            raise UnsupportedOp(f"{name}: its output is not a symbolic int")
        self.out: SymInt = args[-1]
        if name == "sym_size.int":
            tensor_arg(name, args[0], "input")

    def resize(self) -> None:
        if self.name == "sym_size.int":
            self.out.value = self.args[0].dims[live(self.args[1])]
        elif self.name == "sym_numel.default":
            self.out.value = self.args[0].numel
        else:
            self.out.value = _ARITHMETIC[self.name](live(self.args[0]), live(self.args[1]))

    def encode(self, recording: Recording) -> None:
        return


OPS: dict[str, type[GpuOp]] = dict.fromkeys(
    ("sym_size.int", "sym_numel.default", *_ARITHMETIC), SymbolOp
)
