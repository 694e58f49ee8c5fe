"""Matrix products: linear, mm, bmm, addmm, as one tiled batched kernel with strided operands.

out[b, m, n] = sum_k A[b, m, k] * B[b, k, n] (+ bias[m, n], broadcast), where A and B are read
through strides: linear's weight [N, K] is B with stride 1 along k and K along n, so no
transposed copy is ever made.

Parameter words: 0 M, 1 N, 2 K, 3..5 A's strides (batch, m, k), 6..8 B's (batch, k, n),
9..10 the bias strides (m, n), 11..12 alpha and beta (addmm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from runtimes.loaders.webgpu.kernels.base import (
    PARAMS_WGSL,
    Dispatch,
    Gpu,
    GpuOp,
    GpuTensor,
    Params,
    Recording,
    UnsupportedOp,
    contiguous_strides,
    tensor_arg,
)

TILE = 16


def _code(bias: bool) -> str:
    bias_binding = "@group(0) @binding(4) var<storage, read> bias: array<f32>;" if bias else ""
    add_bias = "acc = uf(11u) * acc + uf(12u) * bias[row * u(9u) + col * u(10u)];" if bias else ""
    return f"""{PARAMS_WGSL}
@group(0) @binding(1) var<storage, read_write> out0: array<f32>;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
{bias_binding}
var<workgroup> tile_a: array<array<f32, {TILE}>, {TILE}>;
var<workgroup> tile_b: array<array<f32, {TILE}>, {TILE}>;

@compute @workgroup_size({TILE}, {TILE})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
  let M = u(0u); let N = u(1u); let K = u(2u);
  let row = wid.y * {TILE}u + lid.y;
  let col = wid.x * {TILE}u + lid.x;
  let base_a = wid.z * u(3u);
  let base_b = wid.z * u(6u);
  var acc = 0.0;
  let tiles = (K + {TILE - 1}u) / {TILE}u;
  for (var t = 0u; t < tiles; t = t + 1u) {{
    let ka = t * {TILE}u + lid.x;
    let kb = t * {TILE}u + lid.y;
    var va = 0.0;
    if (row < M && ka < K) {{ va = a[base_a + row * u(4u) + ka * u(5u)]; }}
    var vb = 0.0;
    if (kb < K && col < N) {{ vb = b[base_b + kb * u(7u) + col * u(8u)]; }}
    tile_a[lid.y][lid.x] = va;
    tile_b[lid.y][lid.x] = vb;
    workgroupBarrier();
    for (var k = 0u; k < {TILE}u; k = k + 1u) {{
      acc = acc + tile_a[lid.y][k] * tile_b[k][lid.x];
    }}
    workgroupBarrier();
  }}
  if (row < M && col < N) {{
    {add_bias}
    out0[wid.z * M * N + row * N + col] = acc;
  }}
}}
"""


class Matmul(GpuOp):
    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.out = tensor_arg(name, args[-1], "output")
        if name == "aten.addmm.default":
            self.bias = tensor_arg(name, args[0], "bias")
            self.a, self.b = (tensor_arg(name, args[p], f"argument {p}") for p in (1, 2))
        else:
            self.a, self.b = (tensor_arg(name, args[p], f"argument {p}") for p in (0, 1))
            linear_bias = args[2] if name == "aten.linear.default" else None
            self.bias = None if linear_bias is None else tensor_arg(name, linear_bias, "bias")
        tensors: list[GpuTensor] = [self.out, self.a, self.b]
        if self.bias is not None:
            tensors.append(self.bias)
        if any(t.wgsl != "f32" for t in tensors):
            raise UnsupportedOp(f"{name} on {[t.host_dtype for t in tensors]} (float32 only)")
        self.dispatch = Dispatch(gpu, _code(self.bias is not None), tensors)

    def _geometry(self) -> tuple[int, int, int, int, list[int], list[int]]:
        """(batch, M, N, K, A strides, B strides) of the live operands."""
        a, b = self.a.dims, self.b.dims
        if self.name == "aten.linear.default":
            k = a[-1]
            n = b[0]
            return 1, math.prod(a[:-1]), n, k, [0, k, 1], [0, 1, k]
        if self.name == "aten.bmm.default":
            batch, m, k = a
            n = b[2]
            return batch, m, n, k, [m * k, k, 1], [k * n, n, 1]
        m, k = a
        n = b[1]
        return 1, m, n, k, [0, k, 1], [0, n, 1]

    def resize(self) -> None:
        batch, m, n, _, _, _ = self._geometry()
        if self.name == "aten.linear.default":
            dims = [*self.a.dims[:-1], n]
        elif self.name == "aten.bmm.default":
            dims = [batch, m, n]
        else:
            dims = [m, n]
        self.out.set_dims(dims, self.name)

    def encode(self, recording: Recording) -> None:
        batch, m, n, k, a_strides, b_strides = self._geometry()
        params = Params()
        for index, value in enumerate((m, n, k, *a_strides, *b_strides)):
            params.u32(index, value)
        if self.bias is not None:
            dims = self.bias.dims
            strides = contiguous_strides(dims)
            # The bias broadcasts over rows (a [N] vector) or is a full [M, N] matrix.
            params.u32(9, strides[-2] if len(dims) == 2 and dims[0] != 1 else 0)
            params.u32(10, strides[-1] if dims[-1] != 1 else 0)
            alpha, beta = (1.0, 1.0) if self.name == "aten.linear.default" else self._scales()
            params.f32(11, alpha)
            params.f32(12, beta)
        grid = (-(-n // TILE), -(-m // TILE), batch)
        self.dispatch.record(recording, params, grid)

    def _scales(self) -> tuple[float, float]:
        # addmm(bias, a, b, *, beta=1, alpha=1): beta * bias + alpha * (a @ b).
        beta, alpha = self.args[3], self.args[4]
        return float(alpha), float(beta)


OPS: dict[str, type[GpuOp]] = dict.fromkeys(
    ("aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.addmm.default"), Matmul
)
