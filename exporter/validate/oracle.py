"""The float64 oracle without a float64 copy of the model: each submodule's own weights become
float64 while it runs and return to the model's dtype after.

A float64 copy of a bfloat16 model is four times its size; this holds one module's float64
weights at a time (the largest is usually the token embedding or the output projection).
Casting bfloat16, float16 or float32 to float64 and back is exact, so the model is unchanged
afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.hooks import RemovableHandle


@contextlib.contextmanager
def float64_weights(module: torch.nn.Module) -> Iterator[None]:
    handles: list[RemovableHandle] = []
    for submodule in module.modules():
        if _own_floating(submodule):
            swap = _Swap(submodule)
            handles.append(submodule.register_forward_pre_hook(swap.widen))
            handles.append(submodule.register_forward_hook(swap.restore, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
