"""The values of chosen nodes of an exported program on one input, as eager PyTorch computes them:
in float64 (the oracle of a node, as the goldens are of the model's outputs) and at the model's
own dtype (whose error against float64 the reference rule scales).

The float64 run widens each weight only for the op that reads it, and runs with every floating
dtype an op names (a cast, a factory's dtype) read as float64: the exported graph spells the
model's dtype out, where the model's code, run in float64 for the goldens, followed its input.

A quantized model's program calls torchao's quantize ops on its weights' integers, scales and
zero points; the float64 run calls their float64 arithmetic instead
(exporter/quantize/float64_ops.py).

Both runs stop at the last node asked for: a cut near the front of a 1B model is judged without
running the rest of it twice.

A program that writes its buffers in place (a KV cache) is judged at a call after others: each
run starts from the program's buffers, copied, and carries them through the calls before
(`Buffers.after`), the float64 run's in float64, so that the node's value at the call reads the
cache as that run filled it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from exporter.quantize import float64_ops

Inputs = Sequence[torch.Tensor]


@dataclass(frozen=True)
class Buffers:
    """The program's buffers as the float64 run and the run at the model's dtype left them."""

    wide: dict[str, torch.Tensor]
    narrow: dict[str, torch.Tensor]

    @staticmethod
    def after(program: ExportedProgram, calls: Sequence[Inputs]) -> Buffers:
        """The buffers after the program ran `calls` in order from its own buffers."""
        wide, narrow = _initial(program, wide=True), _initial(program, wide=False)
        for inputs in calls:
            _Recorder(program, set(), wide=True).values(inputs, wide)
            _Recorder(program, set(), wide=False).values(inputs, narrow)
        return Buffers(wide, narrow)

    def copied(self) -> Buffers:
        return Buffers(_cloned(self.wide), _cloned(self.narrow))


def node_values(
    program: ExportedProgram,
    inputs: Inputs,
    names: Iterable[str],
    buffers: Buffers | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per node of `names`: (its float64 value, its value at the model's dtype), from the
    program's own buffers or from `buffers` (which the call leaves as it found them)."""
    wanted = set(names)
    start = (buffers or Buffers(_initial(program, True), _initial(program, False))).copied()
    narrow = _Recorder(program, wanted, wide=False).values(inputs, start.narrow)
    wide = _Recorder(program, wanted, wide=True).values(inputs, start.wide)
    return {name: (wide[name], narrow[name]) for name in wanted}


def _initial(program: ExportedProgram, wide: bool) -> dict[str, torch.Tensor]:
    """Copies of the program's buffers (a run writes them in place), widened for the float64
    run."""
    buffers = {
        spec.target: program.state_dict.get(spec.target, program.constants.get(spec.target))
        for spec in program.graph_signature.input_specs
        if spec.kind is InputKind.BUFFER
    }
    return _cloned({k: _widened(v) if wide else v for k, v in buffers.items()})


def _cloned(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in buffers.items()}


class _AllRecorded(Exception):
    """Raised once every node asked for has its value: the rest of the graph is not needed."""


class _Recorder(torch.fx.Interpreter):
    def __init__(self, program: ExportedProgram, wanted: set[str], *, wide: bool) -> None:
        super().__init__(program.graph_module)
        self.program = program
        self.wanted = wanted
        self.wide = wide
        self.recorded: dict[str, torch.Tensor] = {}

    def values(self, inputs: Inputs, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The wanted nodes' values; the program's in-place writes land in `buffers`."""
        user_inputs = iter(inputs)
        args = []
        for spec in self.program.graph_signature.input_specs:
            if spec.kind is InputKind.USER_INPUT:
                value = next(user_inputs)
                args.append(_widened(value) if self.wide else value)
            elif spec.kind is InputKind.TOKEN:
                args.append(torch.empty(0))
            elif spec.kind is InputKind.BUFFER:
                args.append(buffers[spec.target])
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
            # A copy: a later in-place write (the cache's) must not change the value recorded.
            self.recorded[node.name] = value.clone()
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
    quantize_op = float64_ops.float64_op(target)
    if quantize_op is not None:
        return quantize_op(*args, **kwargs)
    bodies = [i for i, arg in enumerate(args) if isinstance(arg, torch.fx.GraphModule)]
    if bodies:
        # wrap_with_autocast(..., body, *inputs), wrap_with_set_grad_enabled(mode, body, *inputs)
        return _Widened(args[bodies[0]]).run(*args[bodies[0] + 1 :])
    return _float64_kernel(target)(*args, **kwargs)


def _float64_kernel(target: Any) -> Any:
    """The op itself, or where its kernel refuses float64 (ExecuTorch's LLM ops take float32
    and the halves), its float64 stand-in."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "llama":
        from exporter.models.llm_ops import FLOAT64

        return FLOAT64.get(target.name(), target)
    return target


def _widened(value: Any) -> Any:
    if _is_subclass(value):
        # A quantized weight: the graph reads its integers, scales and zero points from it,
        # which are widened where an op takes them.
        return value
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float64)
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    return value


def _is_subclass(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter)
