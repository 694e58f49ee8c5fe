"""The one kernel behind element-wise math and data movement: each invocation takes a flat index
over an iteration shape, turns it into a multi-index, and reads and writes every operand at
`offset + sum(index * stride)`. Broadcasting is a stride of 0, a permute permuted strides, a
slice an offset and a scaled stride, a cat one dispatch per input into its part of the output.

Parameter words: 0 the iteration count, 1..6 the iteration dims (padded with leading 1s), then
per operand k (0 the output, 1.. the inputs) its offset at 7k+7 and the stride of dim d at
7k+7+d; scalars from word 36.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtimes.loaders.webgpu.kernels.base import (
    MAX_RANK,
    PARAMS_WGSL,
    WORKGROUP,
    Dispatch,
    Gpu,
    GpuTensor,
    Params,
    Recording,
    UnsupportedOp,
    grid_1d,
)

SCALARS = 36


@dataclass(frozen=True)
class Operand:
    """How one operand is walked in a dispatch: its offset, and its stride for each iteration
    dim (as many as the iteration dims)."""

    offset: int
    strides: Sequence[int]


def kernel(out_wgsl: str, in_wgsl: Sequence[str], body: str, helpers: str = "") -> str:
    """WGSL for an iteration writing `out0[o0] = <body>`; the body reads `in1[o1]`..., the flat
    index `i`, and scalars `uf(36u)`/`ui(36u)`..."""
    if len(in_wgsl) > 3:
        raise UnsupportedOp(f"a strided kernel takes at most 3 inputs, not {len(in_wgsl)}")
    operands = range(len(in_wgsl) + 1)
    bindings = [f"@group(0) @binding(1) var<storage, read_write> out0: array<{out_wgsl}>;"]
    bindings += [
        f"@group(0) @binding({k + 1}) var<storage, read> in{k}: array<{t}>;"
        for k, t in enumerate(in_wgsl, start=1)
    ]
    declare = "\n".join(f"  var o{k} = u({7 * k + 7}u);" for k in operands)
    advance = "\n".join(f"    o{k} = o{k} + idx * u({7 * k + 7}u + d);" for k in operands)
    return f"""{PARAMS_WGSL}
{chr(10).join(bindings)}
{helpers}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {{
  let i = gid.x + gid.y * groups.x * {WORKGROUP}u;
  if (i >= u(0u)) {{ return; }}
  var rem = i;
{declare}
  for (var d = {MAX_RANK}u; d > 0u; d = d - 1u) {{
    let size = u(d);
    let idx = rem % size;
    rem = rem / size;
{advance}
  }}
  out0[o0] = {body};
}}
"""


class StridedDispatch:
    """A dispatch of a strided kernel over the tensors (output first) it was built with."""

    def __init__(self, gpu: Gpu, code: str, tensors: Sequence[GpuTensor]) -> None:
        self.dispatch = Dispatch(gpu, code, tensors)

    def record(
        self,
        recording: Recording,
        dims: Sequence[int],
        operands: Sequence[Operand],
        scalars: Sequence[tuple[float, str]] = (),
    ) -> None:
        if len(dims) > MAX_RANK:
            raise ValueError(f"{len(dims)} dims; kernels index at most {MAX_RANK}")
        pad = MAX_RANK - len(dims)
        params = Params()
        count = 1
        for d, size in enumerate([1] * pad + list(dims), start=1):
            params.u32(d, size)
            count *= size
        params.u32(0, count)
        for k, operand in enumerate(operands):
            params.u32(7 * k + 7, operand.offset)
            for d, stride in enumerate([0] * pad + list(operand.strides), start=1):
                params.u32(7 * k + 7 + d, stride)
        for j, (value, wgsl) in enumerate(scalars):
            params.scalar(SCALARS + j, value, wgsl)
        self.dispatch.record(recording, params, (*grid_1d(-(-count // WORKGROUP)), 1))
