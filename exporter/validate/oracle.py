"""The float64 oracle without a float64 copy of the model: each submodule's own weights become
float64 while it runs and return to the model's dtype after.

A float64 copy of a bfloat16 model is four times its size; this holds one module's float64
weights at a time. Casting bfloat16, float16 or float32 to float64 and back is exact, so the
model is unchanged afterwards. The largest modules of a language model are the token embedding
and the output projection (a 1B model's are 0.5 GB in bfloat16, 2 GB in float64): an embedding
looks its rows up at the model's dtype and widens them, which is exact, and a linear layer
widens a slice of its output rows at a time.

A layer quantized by the quantize stage (torchao's quantized weight) computes its own arithmetic
in float64 instead: its stored integers, scales and zero points widened, and its activations
quantized as torchao does (exporter/validate/quantized_layers.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from exporter.quantize.packed import PackedEmbedding, PackedLinear
from exporter.validate import quantized_layers


@contextlib.contextmanager
def float64_weights(module: torch.nn.Module, ties_flipped: bool = False) -> Iterator[None]:
    """`module` computing in float64 for the length of the block; `ties_flipped`: its quantized
    layers' activations within a near tie rounded the other way (quantized_layers.py)."""
    undo: list[Callable[[], object]] = []
    try:
        for submodule in module.modules():
            quantized = _quantized_forward(submodule)
            if quantized is not None and "forward" not in vars(submodule):
                submodule.forward = functools.partial(
                    quantized, submodule, ties_flipped=ties_flipped
                )
                undo.append(functools.partial(delattr, submodule, "forward"))
            elif type(submodule) is torch.nn.Embedding:
                undo.append(submodule.register_forward_hook(_widen_output).remove)
            elif type(submodule) is torch.nn.Linear and "forward" not in vars(submodule):
                # An instance attribute shadows the class's forward for this module only.
                submodule.forward = functools.partial(_linear_in_slices, submodule)
                undo.append(functools.partial(delattr, submodule, "forward"))
            elif _own_floating(submodule):
                swap = _Swap(submodule)
                undo.append(submodule.register_forward_pre_hook(swap.widen).remove)
                hook = submodule.register_forward_hook(swap.restore, always_call=True)
                undo.append(hook.remove)
        yield
    finally:
        for step in undo:
            step()


def _quantized_forward(module: torch.nn.Module) -> Callable | None:
    """The float64 forward of a linear or embedding layer whose weight is quantized; None for
    any other module."""
    if isinstance(module, PackedLinear | PackedEmbedding):
        return _packed_float64
    weight = getattr(module, "weight", None)
    if weight is None or not quantized_layers.is_quantized(weight):
        return None
    if type(module) is torch.nn.Linear:
        return quantized_layers.linear
    if type(module) is torch.nn.Embedding:
        return quantized_layers.embedding
    return None


def _packed_float64(
    module: PackedLinear | PackedEmbedding, x: torch.Tensor, ties_flipped: bool = False
) -> torch.Tensor:
    """A packed layer (exporter/quantize/packed.py) on its stored codes, scales and zeros, every
    factor widened; it rounds no activation to an integer, so there are no ties to flip."""
    return module.float64(x)


def _own_floating(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """(the module's own parameter or buffer table, a name in it) of each floating tensor."""
    tables = (module._parameters, module._buffers)
    return [
        (table, name)
        for table in tables
        for name, tensor in table.items()
        if tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float64
    ]


class _Swap:
    """Puts float64 copies of one module's own tensors in place for the length of its call.
    A module called again while it runs (recursion) keeps the copies until the outer call ends."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.depth = 0
        self.originals: list[tuple[dict, str, torch.Tensor]] = []

    def widen(self, module: torch.nn.Module, args: object) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        for table, name in _own_floating(module):
            original = table[name]
            wide = original.detach().to(torch.float64)
            if isinstance(original, torch.nn.Parameter):
                wide = torch.nn.Parameter(wide, requires_grad=False)
            self.originals.append((table, name, original))
            table[name] = wide

    def restore(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for table, name, original in self.originals:
            table[name] = original
        self.originals.clear()


def _widen_output(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
    return output.to(torch.float64)


def _linear_in_slices(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer in float64, its weight widened a slice of output rows at a time."""
    x = x.to(torch.float64)
    rows = max(1, quantized_layers.SLICE_ELEMENTS // module.in_features)
    slices = []
    for start in range(0, module.out_features, rows):
        weight = module.weight[start : start + rows].to(torch.float64)
        bias = None if module.bias is None else module.bias[start : start + rows].to(torch.float64)
        slices.append(torch.nn.functional.linear(x, weight, bias))
    return torch.cat(slices, dim=-1)
