"""The delegated ops this runtime runs, by the name a VkGraph's OperatorCall gives them: each
family module's OPS maps its names to the GpuOp class built for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtimes.loaders.webgpu.kernels import (
    elementwise,
    embedding,
    layout,
    matmul,
    reduction,
    spatial,
    symbolic,
)
from runtimes.loaders.webgpu.kernels.base import Gpu, GpuOp, UnsupportedOp

BUILDERS: dict[str, type[GpuOp]] = {
    **elementwise.OPS,
    **layout.OPS,
    **matmul.OPS,
    **reduction.OPS,
    **embedding.OPS,
    **spatial.OPS,
    **symbolic.OPS,
}


def build(gpu: Gpu, name: str, args: Sequence[Any]) -> GpuOp:
    if name not in BUILDERS:
        raise UnsupportedOp(name)
    return BUILDERS[name](gpu, name, args)
