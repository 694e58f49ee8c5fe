"""Element-wise ops: arithmetic, comparisons, logic, unary math, gelu, where, fills, casts, arange.

Each op is a row of RULES: which arguments are tensors, which are scalars, how its values are
computed (the WGSL type the math runs in) and how its output shape follows (broadcast of the
inputs, like an argument, from a size list, or arange's count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtimes.loaders.webgpu.kernels.base import (
    Gpu,
    GpuOp,
    Recording,
    UnsupportedOp,
    contiguous_strides,
    live,
    tensor_arg,
)
from runtimes.loaders.webgpu.kernels.strided import Operand, StridedDispatch, kernel

# x ** e for every sign of x: WGSL's pow is undefined for x < 0.
_POW = """
fn powf(x: f32, e: f32) -> f32 {
  if (e == 2.0) { return x * x; }
  if (e == 1.0) { return x; }
  let r = pow(abs(x), e);
  if (x < 0.0 && fract(e) == 0.0 && fract(e * 0.5) != 0.0) { return -r; }
  return r;
}
"""

# erf, which WGSL lacks: Norbert Juffa's float erff, an odd polynomial near zero and
# 1 - exp(polynomial) beyond (within 1.2 ulps of erf on [-6, 6], measured in float32 with fma on
# the host; tests/test_webgpu_kernels.py measures the gelu made of it on the GPU).
_ERF = """
fn erff(a: f32) -> f32 {
  let t = abs(a);
  let s = a * a;
  if (t > 0.927734375) {
    var r = fma(-1.72853470e-5, t, 3.83197126e-4);
    let u = fma(-3.88396438e-3, t, 2.42546219e-2);
    r = fma(r, s, u);
    r = fma(r, t, -1.06777877e-1);
    r = fma(r, t, -6.34846687e-1);
    r = fma(r, t, -1.28717512e-1);
    r = fma(r, t, -t);
    return sign(a) * (1.0 - exp(r));
  }
  var r = -5.96761703e-4;
  r = fma(r, s, 4.99119423e-3);
  r = fma(r, s, -2.67681349e-2);
  r = fma(r, s, 1.12819925e-1);
  r = fma(r, s, -3.76125336e-1);
  r = fma(r, s, 1.28379166e-1);
  return fma(r, a, a);
}
"""

# tanh-GELU; tanh's argument is clamped, where tanh is +-1 in float32 already, so that a tanh
# computed from exponentials never sees inf / inf (x**3 overflows from |x| ~ 7e12).
_GELU_TANH = """
fn gelu_tanh(x: f32) -> f32 {
  let inner = 0.7978845608028654 * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + tanh(clamp(inner, -10.0, 10.0)));
}
"""

# WGSL helper functions by the name a body calls them by.
_HELPERS = {"powf": _POW, "erff": _ERF, "gelu_tanh": _GELU_TANH}

_F32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Rule:
    # The WGSL type the body computes in: "out" (the output's), "f32", or "inputs" (f32 if any
    # input or scalar is floating, else i32: comparisons and logic).
    compute: str
    # WGSL; {a} {b} {c}: the inputs cast to the compute type, {ra}: the first input as stored,
    # {s0} {s1} {s2}: scalars in the compute type, {i}: the output's flat index.
    body: str
    tensors: tuple[int, ...] = (0, 1)
    # (argument position, value when the argument is None).
    scalars: tuple[tuple[int, float], ...] = ()
    # broadcast | like (argument 0's shape) | size (argument 0 is a size list) | arange
    shape: str = "broadcast"
    # The body is a WGSL bool (comparisons, logic), stored as 0 or 1.
    boolean: bool = False


def _binary(body: str, compute: str = "out", **kw: Any) -> Rule:
    return Rule(compute, body, **kw)


def _unary(body: str, compute: str = "f32", boolean: bool = False) -> Rule:
    return Rule(compute, body, tensors=(0,), boolean=boolean)


def _compare(symbol: str) -> dict[str, Rule]:
    return {
        "Tensor": Rule("inputs", f"{{a}} {symbol} {{b}}", boolean=True),
        "Scalar": Rule(
            "inputs", f"{{a}} {symbol} {{s0}}", tensors=(0,), scalars=((1, 0),), boolean=True
        ),
    }


_CAST = Rule("out", "{a}", tensors=(0,))

RULES: dict[str, Rule] = {
    "aten.add.Tensor": _binary("{a} + {b} * {s0}", scalars=((2, 1),)),
    "aten.sub.Tensor": _binary("{a} - {b} * {s0}", scalars=((2, 1),)),
    "aten.mul.Tensor": _binary("{a} * {b}"),
    "aten.div.Tensor": _binary("{a} / {b}", compute="f32"),
    "aten.pow.Tensor_Tensor": _binary("powf({a}, {b})", compute="f32"),
    "aten.maximum.default": _binary("max({a}, {b})"),
    "aten.minimum.default": _binary("min({a}, {b})"),
    "aten.add.Scalar": Rule("out", "{a} + {s0} * {s1}", (0,), ((1, 0), (2, 1))),
    "aten.sub.Scalar": Rule("out", "{a} - {s0} * {s1}", (0,), ((1, 0), (2, 1))),
    "aten.mul.Scalar": Rule("out", "{a} * {s0}", (0,), ((1, 1),)),
    # torch's clamp is min(max(x, low), high), whichever bound is greater; a bound left None
    # is the float's end.
    "aten.clamp.default": Rule(
        "f32", "min(max({a}, {s0}), {s1})", (0,), ((1, -_F32_MAX), (2, _F32_MAX))
    ),
    "aten.div.Scalar": Rule("f32", "{a} / {s0}", (0,), ((1, 1),)),
    "aten.pow.Tensor_Scalar": Rule("f32", "powf({a}, {s0})", (0,), ((1, 1),)),
    "aten.logical_and.default": _binary("({a} != 0) && ({b} != 0)", compute="inputs", boolean=True),
    "aten.logical_or.default": _binary("({a} != 0) || ({b} != 0)", compute="inputs", boolean=True),
    "aten.bitwise_and.Tensor": _binary("{a} & {b}", compute="inputs"),
    "aten.bitwise_or.Tensor": _binary("{a} | {b}", compute="inputs"),
    "aten.logical_not.default": _unary("{a} == 0", compute="inputs", boolean=True),
    "aten.neg.default": _unary("-{a}", compute="out"),
    "aten.abs.default": _unary("abs({a})", compute="out"),
    "aten.relu.default": _unary("max({a}, 0)", compute="out"),
    "aten.sin.default": _unary("sin({a})"),
    "aten.cos.default": _unary("cos({a})"),
    "aten.exp.default": _unary("exp({a})"),
    "aten.log.default": _unary("log({a})"),
    "aten.sqrt.default": _unary("sqrt({a})"),
    "aten.rsqrt.default": _unary("inverseSqrt({a})"),
    "aten.tanh.default": _unary("tanh({a})"),
    "aten.sigmoid.default": _unary("1.0 / (1.0 + exp(-{a}))"),
    "aten.silu.default": _unary("{a} / (1.0 + exp(-{a}))"),
    "aten.where.self": Rule("out", "select({c}, {b}, {ra} != 0)", tensors=(0, 1, 2)),
    "aten.full_like.default": Rule("out", "{s0}", (), ((1, 0),), shape="like"),
    "aten.full.default": Rule("out", "{s0}", (), ((1, 0),), shape="size"),
    "aten.arange.start_step": Rule(
        "out", "{s0} + {cast}({i}) * {s2}", (), ((0, 0), (1, 0), (2, 1)), shape="arange"
    ),
    "aten.clone.default": _CAST,
    "aten.alias_copy.default": _CAST,
    "aten._to_copy.default": _CAST,
    "dim_order_ops._clone_dim_order.default": _CAST,
    "dim_order_ops._to_dim_order_copy.default": _CAST,
}
# gelu by its `approximate` argument.
GELUS: dict[str, Rule] = {
    "none": _unary("0.5 * {a} * (1.0 + erff({a} * 0.7071067811865476))"),
    "tanh": _unary("gelu_tanh({a})"),
}
# Ops whose output holds its input's values, converted to the output's type.
COPIES = tuple(name for name, rule in RULES.items() if rule is _CAST)

for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _symbol = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[_name]
    for _overload, _rule in _compare(_symbol).items():
        RULES[f"aten.{_name}.{_overload}"] = _rule


def broadcast(shapes: Sequence[Sequence[int]]) -> list[int]:
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for shape in shapes:
        for d, size in enumerate(shape, start=rank - len(shape)):
            if size != 1:
                if out[d] not in (1, size):
                    raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
                out[d] = size
    return out


def broadcast_strides(dims: Sequence[int], out_dims: Sequence[int]) -> list[int]:
    """Strides that walk a contiguous tensor of `dims` over `out_dims`: 0 where it repeats."""
    strides = contiguous_strides(dims)
    pad = len(out_dims) - len(dims)
    return [0] * pad + [
        0 if size == 1 and out_dims[pad + d] != 1 else strides[d] for d, size in enumerate(dims)
    ]


class Elementwise(GpuOp):
    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.rule = self.rule_of(name, args)
        self.out = tensor_arg(name, args[-1], "output")
        self.inputs = [tensor_arg(name, args[p], f"argument {p}") for p in self.rule.tensors]
        self.compute = self._compute_type()
        self.dispatch = StridedDispatch(gpu, self._code(), [self.out, *self.inputs])

    def rule_of(self, name: str, args: Sequence[Any]) -> Rule:
        return RULES[name]

    def _scalar_values(self) -> list[Any]:
        return [
            default if self.args[p] is None else live(self.args[p])
            for p, default in self.rule.scalars
        ]

    def _compute_type(self) -> str:
        if self.rule.compute == "out":
            return self.out.wgsl
        if self.rule.compute == "f32":
            return "f32"
        floating = any(t.wgsl == "f32" for t in self.inputs) or any(
            isinstance(v, float) for v in self._scalar_values()
        )
        return "f32" if floating else "i32"

    def _code(self) -> str:
        compute = self.compute
        loads = {
            name: f"{compute}(in{k}[o{k}])"
            for k, name in enumerate(("a", "b", "c")[: len(self.inputs)], start=1)
        }
        body = self.rule.body.format(
            **loads,
            ra="in1[o1]",
            s0=f"{'uf' if compute == 'f32' else 'ui'}(36u)",
            s1=f"{'uf' if compute == 'f32' else 'ui'}(37u)",
            s2=f"{'uf' if compute == 'f32' else 'ui'}(38u)",
            cast=compute,
            i="i",
        )
        if self.out.host_dtype == "bool" and not self.rule.boolean:
            # A bool output of numbers (a cast, a product of bools) is whether they are nonzero.
            body = f"({body}) != {compute}(0)"
        helpers = "".join(code for function, code in _HELPERS.items() if f"{function}(" in body)
        inputs = [t.wgsl for t in self.inputs]
        return kernel(self.out.wgsl, inputs, f"{self.out.wgsl}({body})", helpers)

    def resize(self) -> None:
        shape = self.rule.shape
        if shape == "broadcast":
            dims = broadcast([t.dims for t in self.inputs])
        elif shape == "like":
            dims = tensor_arg(self.name, self.args[0], "argument 0").dims
        elif shape == "size":
            dims = live(self.args[0])
        else:
            start, end, step = self._scalar_values()
            dims = [max(0, math.ceil((end - start) / step))]
        self.out.set_dims(dims, self.name)

    def encode(self, recording: Recording) -> None:
        dims = self.out.dims
        operands = [Operand(0, contiguous_strides(dims))]
        operands += [Operand(0, broadcast_strides(t.dims, dims)) for t in self.inputs]
        scalars = [(value, self.compute) for value in self._scalar_values()]
        self.dispatch.record(recording, dims, operands, scalars)


class Gelu(Elementwise):
    """gelu(x, approximate): the exact (erf) GELU or its tanh approximation, as the op asks."""

    def rule_of(self, name: str, args: Sequence[Any]) -> Rule:
        approximate = args[1] if len(args) > 2 else "none"
        if approximate not in GELUS:
            raise UnsupportedOp(f"{name} with approximate={approximate!r} (none or tanh)")
        return GELUS[approximate]


OPS: dict[str, type[GpuOp]] = {**dict.fromkeys(RULES, Elementwise), "aten.gelu.default": Gelu}
