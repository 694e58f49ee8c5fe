"""The declared dims as torch.export's dynamic-shapes spec, and the check that export kept them.

Backed dims become `torch.export.Dim(name, min, max)`: export guards on the example's sizes and
refuses a guard that would narrow a Dim. Unbacked dims become `ShapeVar`s of torch's ShapesSpec
API (`torch.fx.experimental.dynamic_spec`, torch 2.14): no size hint, so no guard can specialize
them; what would have needed one fails as a data-dependent error instead, or becomes a runtime
assert that pins the dim, which `narrowed` reports as it does a narrowed backed dim.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind

from exporter.config import DimMode
from exporter.models import DynamicDim, ModelBundle

if TYPE_CHECKING:
    from torch.fx.experimental.dynamic_spec import ShapesSpec


def spec(bundle: ModelBundle, mode: DimMode | None = None) -> Any:
    """The spec for the bundle's dims, in their declared mode or in `mode` if given."""
    dynamic = [dim for dim in bundle.dims if not dim.is_static]
    declared = dynamic[0].mode if dynamic else DimMode.backed
    if (mode or declared) is DimMode.unbacked:
        return _unbacked(bundle, dynamic)
    return _backed(bundle, dynamic)


def _backed(bundle: ModelBundle, dims: list[DynamicDim]) -> tuple[dict[int, Any] | None, ...]:
    """Positional, one shared `Dim` per named dim on every axis carrying it."""
    per_input: dict[str, dict[int, Any] | None] = {name: None for name in bundle.input_names}
    for dim in dims:
        export_dim = Dim(dim.name, min=dim.min, max=dim.max)
        for input_name, axis in dim.axes:
            per_input[input_name] = {**(per_input[input_name] or {}), axis: export_dim}
    return tuple(per_input[name] for name in bundle.input_names)


def _unbacked(bundle: ModelBundle, dims: list[DynamicDim]) -> ShapesSpec:
    """ShapesSpec is keyed by forward's parameter names; our inputs are positional, in order."""
    # Imported here: torch releases before 2.14 lack the module, and backed dims need none of it.
    from torch.fx.experimental.dynamic_spec import ShapesSpec, ShapeVar, TensorSpec

    example = bundle.make_inputs(bundle.max_sizes(), 0)
    parameters = list(inspect.signature(bundle.module.forward).parameters)
    variables = {dim.name: ShapeVar(dim.name, min=dim.min, max=dim.max) for dim in dims}
    tensors = {}
    for position, (input_name, tensor) in enumerate(zip(bundle.input_names, example, strict=True)):
        sizes: list[Any] = list(tensor.shape)
        for dim in dims:
            for name, axis in dim.axes:
                if name == input_name:
                    sizes[axis] = variables[dim.name]
        tensors[parameters[position]] = TensorSpec(sizes)
    return ShapesSpec(tensors)


@dataclass(frozen=True)
class Narrowing:
    """A declared-dynamic dim that export kept only for lower..upper (equal: a constant)."""

    dim: DynamicDim
    lower: int
    upper: int


def narrowed(program: ExportedProgram, bundle: ModelBundle) -> list[Narrowing]:
    """Each declared-dynamic dim that came out of export static or narrower."""
    inputs = [
        node.meta["val"]
        for node, input_spec in zip(
            program.graph.find_nodes(op="placeholder"),
            program.graph_signature.input_specs,
            strict=True,
        )
        if input_spec.kind is InputKind.USER_INPUT
    ]
    by_name = dict(zip(bundle.input_names, inputs, strict=True))
    found = []
    for dim in bundle.dims:
        if dim.is_static:
            continue
        input_name, axis = dim.axes[0]
        size = by_name[input_name].shape[axis]
        # A SymInt can stand for a constant too: an unbacked dim that a runtime assert pinned.
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if expr is None or not expr.free_symbols:
            found.append(Narrowing(dim, int(size), int(size)))
            continue
        bounds = program.range_constraints.get(expr)
        if bounds is not None and (bounds.lower > dim.min or bounds.upper < dim.max):
            lower = max(dim.min, int(bounds.lower))
            upper = min(dim.max, int(bounds.upper)) if bounds.upper.is_finite else dim.max
            found.append(Narrowing(dim, lower, upper))
    return found


@dataclass(frozen=True)
class InputProfile:
    """One input's shapes at the lower and upper bounds of its dims and at a size between them:
    what an optimization profile (TensorRT's min/opt/max) takes. `dims` names each dynamic axis;
    a dim shared by several inputs has one name on all of them."""

    name: str
    dtype: torch.dtype
    min_shape: tuple[int, ...]
    opt_shape: tuple[int, ...]
    max_shape: tuple[int, ...]
    dims: dict[int, str]


def opt_size(dim: DynamicDim) -> int:
    """The middle of the bounds: strictly between min and max where two sizes lie apart by more
    than one; a dim of two sizes has nothing between, and takes its max."""
    if dim.max - dim.min < 2:
        return dim.max
    return (dim.min + dim.max) // 2


def profiles(bundle: ModelBundle) -> tuple[InputProfile, ...]:
    low = bundle.make_inputs({dim.name: dim.min for dim in bundle.dims}, 0)
    middle = bundle.make_inputs({dim.name: opt_size(dim) for dim in bundle.dims}, 0)
    high = bundle.make_inputs(bundle.max_sizes(), 0)
    named: dict[str, dict[int, str]] = {name: {} for name in bundle.input_names}
    for dim in bundle.dims:
        if not dim.is_static:
            for input_name, axis in dim.axes:
                named[input_name][axis] = dim.name
    return tuple(
        InputProfile(
            name, low[i].dtype, *(tuple(x[i].shape) for x in (low, middle, high)), named[name]
        )
        for i, name in enumerate(bundle.input_names)
    )
