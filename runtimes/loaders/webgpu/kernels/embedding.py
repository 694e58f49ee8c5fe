"""embedding(weight, indices): out[..., h] = weight[indices[...], h], one invocation per element.

Ids outside the table are clamped to its first or last row: ATen would raise there; a GPU
cannot, so it must at least stay inside its buffer.

Parameter words: 0 the output's element count, 1 the row width H, 2 the table's row count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtimes.loaders.webgpu.kernels.base import (
    PARAMS_WGSL,
    WORKGROUP,
    Dispatch,
    Gpu,
    GpuOp,
    Params,
    Recording,
    UnsupportedOp,
    grid_1d,
    tensor_arg,
)

_CODE = f"""{PARAMS_WGSL}
@group(0) @binding(1) var<storage, read_write> out0: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<i32>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {{
  let i = gid.x + gid.y * groups.x * {WORKGROUP}u;
  if (i >= u(0u)) {{ return; }}
  let width = u(1u);
  let row = u32(clamp(ids[i / width], 0, i32(u(2u)) - 1));
  out0[i] = table[row * width + i % width];
}}
"""


class Embedding(GpuOp):
    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.table = tensor_arg(name, args[0], "weight")
        self.ids = tensor_arg(name, args[1], "indices")
        self.out = tensor_arg(name, args[-1], "output")
        if self.table.wgsl != "f32" or self.ids.wgsl != "i32":
            raise UnsupportedOp(
                f"{name} of a {self.table.host_dtype} table by {self.ids.host_dtype} ids"
            )
        self.dispatch = Dispatch(gpu, _CODE, [self.out, self.table, self.ids])

    def resize(self) -> None:
        self.out.set_dims([*self.ids.dims, self.table.dims[-1]], self.name)

    def encode(self, recording: Recording) -> None:
        params = Params()
        params.u32(0, self.out.numel)
        params.u32(1, self.table.dims[-1])
        params.u32(2, self.table.dims[0])
        groups = -(-self.out.numel // WORKGROUP)
        self.dispatch.record(recording, params, (*grid_1d(groups), 1) if groups else (0, 0, 0))


OPS: dict[str, type[GpuOp]] = {"aten.embedding.default": Embedding}
