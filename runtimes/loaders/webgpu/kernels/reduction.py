"""Ops that reduce along one dim, or several adjacent ones: softmax, log_softmax, RMS norm,
layer norm, mean, sum, amax.

A row is every element along the reduced dims for one position of the others: with the input
viewed as [outer, R, inner] (R the product of the reduced dims), row r starts at
(r / inner) * R * inner + r % inner and steps by inner. One workgroup reduces one row in
workgroup memory, then writes the row (softmax, norms) or its one value (mean, sum, amax).

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


def _layer_norm(weight: bool, bias: bool) -> str:
    """Layer norm's body: two passes over the row (the mean, then the variance around it, which
    E[x^2] - E[x]^2 would lose to cancellation), then the row normalized, scaled where there is
    a weight and shifted where there is a bias; and the row's mean and 1 / standard deviation,
    the op's other outputs."""
    value = "(x[base + j * inner] - mu) * rstd"
    value = f"{value} * weight[j]" if weight else value
    value = f"{value} + bias[j]" if bias else value
    return (
        "var acc = 0.0;\n"
        + _loop("acc = acc + x[base + j * inner];")
        + _tree("total", _SUM)
        + "let mu = total / f32(R);\n"
        + "acc = 0.0;\n"
        + _loop("let d = x[base + j * inner] - mu; acc = acc + d * d;")
        + _tree("squares", _SUM)
        + "let rstd = inverseSqrt(squares / f32(R) + uf(3u));\n"
        + _loop(f"out0[base + j * inner] = {value};")
        + "if (lid.x == 0u) { mean[row] = mu; rstd_out[row] = rstd; }"
    )


def _code(body: str, written: Sequence[str] = (), read: Sequence[str] = ()) -> str:
    """A row kernel running `body`: it binds out0 and x, then the f32 tensors named in
    `written`, then those in `read`."""
    bindings = [
        f"@group(0) @binding({k}) var<storage, {access}> {name}: array<f32>;"
        for k, (name, access) in enumerate(
            [*((n, "read_write") for n in written), *((n, "read") for n in read)], start=3
        )
    ]
    return f"""{PARAMS_WGSL}
@group(0) @binding(1) var<storage, read_write> out0: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
{chr(10).join(bindings)}
var<workgroup> part: array<f32, {WORKGROUP}>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {{
  let row = wid.x + wid.y * groups.x;
  if (row >= u(0u)) {{ return; }}
  let R = u(1u);
  let inner = u(2u);
  let base = (row / inner) * R * inner + row % inner;
{body}
}}
"""


def _record_rows(
    dispatch: Dispatch, recording: Recording, dims: Sequence[int], first: int, last: int, eps: float
) -> None:
    """Records a row kernel over `dims`, reducing dims first..last (adjacent)."""
    reduced = math.prod(dims[first : last + 1])
    rows = math.prod(dims) // reduced if reduced else 0
    params = Params()
    params.u32(0, rows)
    params.u32(1, reduced)
    params.u32(2, math.prod(dims[last + 1 :]))
    params.f32(3, eps)
    dispatch.record(recording, params, (*grid_1d(rows), 1) if rows else (0, 0, 0))


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
        self.eps = 0.0
        if self.kind == "rms_norm":
            tensors.append(tensor_arg(name, args[1], "weight"))
            self.eps = float(args[2])
        if any(t.wgsl != "f32" for t in tensors):
            raise UnsupportedOp(f"{name} on {[t.host_dtype for t in tensors]} (float32 only)")
        dims = args[dim_at] if dim_at is not None else [-1]
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        rank = self.input.rank
        # No dims: all of them, as ATen reads an empty dim list.
        reduced = sorted({d % rank for d in dims}) if dims else list(range(rank))
        if reduced != list(range(reduced[0], reduced[-1] + 1)):
            raise UnsupportedOp(f"{name} over dims {dims} (adjacent dims only)")
        self.first, self.last = reduced[0], reduced[-1]
        self.keepdim = bool(args[keepdim_at]) if keepdim_at is not None else True
        read = ("weight",) if self.kind == "rms_norm" else ()
        self.dispatch = Dispatch(gpu, _code(_BODIES[self.kind], read=read), tensors)

    def resize(self) -> None:
        dims = list(self.input.dims)
        if self.kind in ("mean", "sum", "amax"):
            kept = [1] * (self.last + 1 - self.first) if self.keepdim else []
            dims[self.first : self.last + 1] = kept
        self.out.set_dims(dims, self.name)

    def encode(self, recording: Recording) -> None:
        _record_rows(self.dispatch, recording, self.input.dims, self.first, self.last, self.eps)


class LayerNorm(GpuOp):
    """native_layer_norm(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd): each row
    of x's trailing len(normalized_shape) dims normalized; weight and bias may be None."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.input = tensor_arg(name, args[0], "input")
        self.normalized = len(args[1])
        weight, bias = (
            None if args[p] is None else tensor_arg(name, args[p], what)
            for p, what in ((2, "weight"), (3, "bias"))
        )
        self.eps = float(args[4])
        self.out, self.mean, self.rstd = (
            tensor_arg(name, t, f"output {k}") for k, t in enumerate(args[-1])
        )
        affine = [t for t in (weight, bias) if t is not None]
        tensors = [self.out, self.input, self.mean, self.rstd, *affine]
        if any(t.wgsl != "f32" for t in tensors):
            raise UnsupportedOp(f"{name} on {[t.host_dtype for t in tensors]} (float32 only)")
        read = [what for t, what in ((weight, "weight"), (bias, "bias")) if t is not None]
        body = _layer_norm(weight is not None, bias is not None)
        self.dispatch = Dispatch(gpu, _code(body, ("mean", "rstd_out"), read), tensors)

    def resize(self) -> None:
        dims = list(self.input.dims)
        self.out.set_dims(dims, self.name)
        rows = dims[: len(dims) - self.normalized] + [1] * self.normalized
        self.mean.set_dims(rows, self.name)
        self.rstd.set_dims(rows, self.name)

    def encode(self, recording: Recording) -> None:
        rank = self.input.rank
        first = rank - self.normalized
        _record_rows(self.dispatch, recording, self.input.dims, first, rank - 1, self.eps)


OPS: dict[str, type[GpuOp]] = {
    **dict.fromkeys(_OPS, Reduction),
    "aten.native_layer_norm.default": LayerNorm,
}
