"""The values of chosen nodes of an exported program on one input, as eager PyTorch computes them:
in float64 (the oracle of a node, as the goldens are of the model's outputs) and at the model's
own dtype (whose error against float64 the reference rule scales).

The float64 run widens each weight only for the op that reads it, and runs with every floating
dtype an op names (a cast, a factory's dtype) read as float64: the exported graph spells the
model's dtype out, where the model's code, run in float64 for the goldens, followed its input.

Both runs stop at the last node asked for: a cut near the front of a 1B model is judged without
running the rest of it twice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree


def node_values(
    program: ExportedProgram, inputs: Sequence[torch.Tensor], names: Iterable[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per node of `names`: (its float64 value, its value at the model's dtype)."""
    wanted = set(names)
    narrow = _Recorder(program, wanted, wide=False).values(inputs)
    wide = _Recorder(program, wanted, wide=True).values(inputs)
    return {name: (wide[name], narrow[name]) for name in wanted}


class _AllRecorded(Exception):
    """Raised once every node asked for has its value: the rest of the graph is not needed."""


class _Recorder(torch.fx.Interpreter):
    def __init__(self, program: ExportedProgram, wanted: set[str], *, wide: bool) -> None:
        super().__init__(program.graph_module)
        self.program = program
        self.wanted = wanted
        self.wide = wide
        self.recorded: dict[str, torch.Tensor] = {}

    def values(self, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        user_inputs = iter(inputs)
        args = []
        for spec in self.program.graph_signature.input_specs:
            if spec.kind is InputKind.USER_INPUT:
                value = next(user_inputs)
                args.append(_widened(value) if self.wide else value)
            elif spec.kind is InputKind.TOKEN:
                args.append(torch.empty(0))
            elif spec.target in self.program.state_dict:
                args.append(self.program.state_dict[spec.target])
            else:
                args.append(self.program.constants[spec.target])
        with torch.no_grad(), contextlib.suppress(_AllRecorded):
            self.run(*args)
        return self.recorded

    def run_node(self, node: torch.fx.Node) -> Any:
        value = super().run_node(node)
        if node.name in self.wanted:
            self.recorded[node.name] = value
            if len(self.recorded) == len(self.wanted):
                raise _AllRecorded
        return value

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not self.wide:
            return super().call_function(target, args, kwargs)
        return _call_widened(target, args, kwargs)


class _Widened(torch.fx.Interpreter):
    """Runs a graph with every op widened to float64: the body of a higher-order op (an
    autocast or grad-mode region), whose own settings would narrow it again."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return _call_widened(target, args, kwargs)


def _call_widened(target: Any, args: Any, kwargs: Any) -> Any:
    args, kwargs = pytree.tree_map(_widened, (args, kwargs))
    bodies = [i for i, arg in enumerate(args) if isinstance(arg, torch.fx.GraphModule)]
    if bodies:
        # wrap_with_autocast(..., body, *inputs), wrap_with_set_grad_enabled(mode, body, *inputs)
        return _Widened(args[bodies[0]]).run(*args[bodies[0] + 1 :])
    return target(*args, **kwargs)


def _widened(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float64)
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    return value
