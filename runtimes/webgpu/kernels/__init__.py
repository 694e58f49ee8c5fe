"""The delegated ops this runtime runs, by the name a VkGraph's OperatorCall gives them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from runtimes.webgpu.kernels import elementwise, embedding, layout, matmul, reduction, symbolic
from runtimes.webgpu.kernels.base import Gpu, GpuOp, UnsupportedOp

_FAMILIES: tuple[ModuleType, ...] = (layout, matmul, reduction, embedding, symbolic)

BUILDERS: dict[str, Callable[[Gpu, str, Sequence[Any]], GpuOp]] = {
    name: elementwise.build for name in elementwise.RULES
}
for _family in _FAMILIES:
    BUILDERS.update({name: _family.build for name in _family.NAMES})


def build(gpu: Gpu, name: str, args: Sequence[Any]) -> GpuOp:
    if name not in BUILDERS:
        raise UnsupportedOp(name)
    return BUILDERS[name](gpu, name, args)
