"""Ops that reduce along one dim: softmax, log_softmax, RMS norm, mean, sum, amax.

A row is every element along the reduced dim for one position of the others: with the input
viewed as [outer, R, inner], row r starts at (r / inner) * R * inner + r % inner and steps by
inner. One workgroup reduces one row in workgroup memory, then writes the row (softmax, norm)
or its one value (mean, sum, amax).

Parameter words: 0 rows, 1 R, 2 inner, 3 eps (f32).
"""

from __future__ import annotations

import math
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

# Combines the 64 partial values of a workgroup into part[0]; `op` joins two of them.
_TREE = """
  part[lid.x] = acc;
  workgroupBarrier();
  for (var s = {half}u; s > 0u; s = s >> 1u) {{
    if (lid.x < s) {{ part[lid.x] = {op}; }}
    workgroupBarrier();
  }}
  let {name} = part[0];
  workgroupBarrier();
"""


def _tree(name: str, op: str) -> str:
    return _TREE.format(half=WORKGROUP // 2, op=op, name=name)


_SUM = "part[lid.x] + part[lid.x + s]"
_MAX = "max(part[lid.x], part[lid.x + s])"
_LOOP = "for (var j = lid.x; j < R; j = j + {w}u) {{ {body} }}"


def _loop(body: str) -> str:
    return _LOOP.format(w=WORKGROUP, body=body)


# The row's max `top`, then `total`, the sum of exp(x - top): softmax without overflow.
_EXP_SUM = (
    "var acc = -3.4028235e38;\n"
    + _loop("acc = max(acc, x[base + j * inner]);")
    + _tree("top", _MAX)
    + "acc = 0.0;\n"
    + _loop("acc = acc + exp(x[base + j * inner] - top);")
    + _tree("total", _SUM)
)

_BODIES = {
    "softmax": _EXP_SUM + _loop("out0[base + j * inner] = exp(x[base + j * inner] - top) / total;"),
    "log_softmax": _EXP_SUM
    + _loop("out0[base + j * inner] = x[base + j * inner] - top - log(total);"),
    "rms_norm": (
        "var acc = 0.0;\n"
        + _loop("let v = x[base + j * inner]; acc = acc + v * v;")
        + _tree("total", _SUM)
        + "let scale = inverseSqrt(total / f32(R) + uf(3u));\n"
        + _loop("out0[base + j * inner] = x[base + j * inner] * scale * weight[j];")
    ),
    "mean": (
        "var acc = 0.0;\n"
        + _loop("acc = acc + x[base + j * inner];")
        + _tree("total", _SUM)
        + "if (lid.x == 0u) { out0[row] = total / f32(R); }"
    ),
    "sum": (
        "var acc = 0.0;\n"
        + _loop("acc = acc + x[base + j * inner];")
        + _tree("total", _SUM)
        + "if (lid.x == 0u) { out0[row] = total; }"
    ),
    "amax": (
        "var acc = -3.4028235e38;\n"
        + _loop("acc = max(acc, x[base + j * inner]);")
        + _tree("top", _MAX)
        + "if (lid.x == 0u) { out0[row] = top; }"
    ),
}


def _code(kind: str) -> str:
    weight = (
        "@group(0) @binding(3) var<storage, read> weight: array<f32>;" if kind == "rms_norm" else ""
    )
    return f"""{PARAMS_WGSL}
@group(0) @binding(1) var<storage, read_write> out0: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
{weight}
var<workgroup> part: array<f32, {WORKGROUP}>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {{
  let row = wid.x + wid.y * groups.x;
  if (row >= u(0u)) {{ return; }}
  let R = u(1u);
  let inner = u(2u);
  let base = (row / inner) * R * inner + row % inner;
{_BODIES[kind]}
}}
"""


# op name -> (kernel, argument position of the dim (None: the last), of keepdim).
_OPS: dict[str, tuple[str, int | None, int | None]] = {
    "aten._softmax.default": ("softmax", 1, None),
    "aten._log_softmax.default": ("log_softmax", 1, None),
    "et_vk.rms_norm.default": ("rms_norm", None, None),
    "aten.mean.dim": ("mean", 1, 2),
    "aten.sum.dim_IntList": ("sum", 1, 2),
    "aten.amax.default": ("amax", 1, 2),
}


class Reduction(GpuOp):
    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.kind, dim_at, keepdim_at = _OPS[name]
        self.input = tensor_arg(name, args[0], "input")
        self.out = tensor_arg(name, args[-1], "output")
        tensors = [self.out, self.input]
        if self.kind == "rms_norm":
            tensors.append(tensor_arg(name, args[1], "weight"))
            self.eps = float(args[2])
        if any(t.wgsl != "f32" for t in tensors):
            raise UnsupportedOp(f"{name} on {[t.host_dtype for t in tensors]} (float32 only)")
        dims = args[dim_at] if dim_at is not None else [-1]
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if len(dims) != 1:
            raise UnsupportedOp(f"{name} over dims {dims} (one dim only)")
        self.dim = dims[0] % self.input.rank
        self.keepdim = bool(args[keepdim_at]) if keepdim_at is not None else True
        self.dispatch = Dispatch(gpu, _code(self.kind), tensors)

    def resize(self) -> None:
        dims = list(self.input.dims)
        if self.kind in ("mean", "sum", "amax"):
            if self.keepdim:
                dims[self.dim] = 1
            else:
                del dims[self.dim]
        self.out.set_dims(dims, self.name)

    def encode(self, recording: Recording) -> None:
        dims = self.input.dims
        reduced = dims[self.dim]
        inner = math.prod(dims[self.dim + 1 :])
        rows = math.prod(dims) // reduced if reduced else 0
        params = Params()
        params.u32(0, rows)
        params.u32(1, reduced)
        params.u32(2, inner)
        if self.kind == "rms_norm":
            params.f32(3, self.eps)
        self.dispatch.record(recording, params, (*grid_1d(rows), 1) if rows else (0, 0, 0))


OPS: dict[str, type[GpuOp]] = dict.fromkeys(_OPS, Reduction)
