"""The kernels a program calls outside its delegates, run on the CPU by PyTorch.

An ATen call in a .pte names its out-variant ("aten::index", "Tensor_out"): torch has the same
op, which resizes its `out` tensor to the live shape as ExecuTorch's portable kernel would.
ExecuTorch's own ops (size arithmetic, dim-order copies) are written here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from runtimes.loaders.webgpu.kernels.base import UnsupportedOp

# A kernel takes the call's argument values and returns the values of its trailing return
# slots (none for an out-variant, which writes its out tensor).
CpuKernel = Callable[[Sequence[Any]], tuple[Any, ...]]


def _prim(function: Callable[..., Any]) -> CpuKernel:
    return lambda args: (function(*args[:-1]),)


_PRIMS: dict[str, Callable[..., Any]] = {
    "executorch_prim::add.Scalar": operator.add,
    "executorch_prim::sub.Scalar": operator.sub,
    "executorch_prim::mul.Scalar": operator.mul,
    "executorch_prim::floordiv.Scalar": operator.floordiv,
    "executorch_prim::truediv.Scalar": operator.truediv,
    "executorch_prim::mod.Scalar": operator.mod,
    "executorch_prim::eq.Scalar": operator.eq,
    "executorch_prim::gt.Scalar": operator.gt,
    "executorch_prim::lt.Scalar": operator.lt,
    "executorch_prim::ge.Scalar": operator.ge,
    "executorch_prim::le.Scalar": operator.le,
    "executorch_prim::neg.Scalar": operator.neg,
    "executorch_prim::sym_max.Scalar": max,
    "executorch_prim::sym_min.Scalar": min,
    "executorch_prim::sym_float.Scalar": float,
    "executorch_prim::ceil.Scalar": math.ceil,
    "executorch_prim::floor.Scalar": math.floor,
    "aten::sym_size.int": lambda tensor, dim: tensor.shape[dim],
    "aten::sym_numel": lambda tensor: tensor.numel(),
}


def _copy_into(args: Sequence[Any]) -> tuple[Any, ...]:
    # _to_dim_order_copy.out / _clone_dim_order.out: self, non_blocking, dim_order, out (the
    # dtype change is the out tensor's own dtype). Every tensor here is contiguous.
    source, out = args[0], args[-1]
    out.resize_(source.shape)
    out.copy_(source)
    return ()


_EXECUTORCH_OPS: dict[str, CpuKernel] = {
    "dim_order_ops::_to_dim_order_copy.out": _copy_into,
    "dim_order_ops::_clone_dim_order.out": _copy_into,
}


def resolve(name: str, overload: str) -> CpuKernel:
    """The kernel for an operator of the program; UnsupportedOp where there is none."""
    full = f"{name}.{overload}" if overload else name
    if full in _PRIMS:
        return _prim(_PRIMS[full])
    if full in _EXECUTORCH_OPS:
        return _EXECUTORCH_OPS[full]
    namespace, _, op_name = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), op_name, None) if op_name else None
    overload_name = overload or "default"
    if packet is None or overload_name not in packet.overloads():
        raise UnsupportedOp(f"{full} (no CPU kernel for it in torch {torch.__version__})")
    return _aten(getattr(packet, overload_name))


def _aten(op: torch._ops.OpOverload) -> CpuKernel:
    schema = op._schema
    arguments = schema.arguments

    def call(args: Sequence[Any]) -> tuple[Any, ...]:
        for argument, value in zip(arguments, args, strict=False):
            if argument.is_out and isinstance(value, torch.Tensor):
                # ExecuTorch resizes an out tensor to each run's live shape; torch does so
                # silently only from empty.
                value.resize_(0)
        positional = [v for a, v in zip(arguments, args, strict=False) if not a.kwarg_only]
        keywords = {a.name: v for a, v in zip(arguments, args, strict=False) if a.kwarg_only}
        result = op(*positional, **keywords)
        # Out-variants return their out tensors, already in place; other ops fill the
        # return slots that follow their arguments.
        if len(args) == len(arguments):
            return ()
        return tuple(result) if isinstance(result, tuple | list) else (result,)

    return call
