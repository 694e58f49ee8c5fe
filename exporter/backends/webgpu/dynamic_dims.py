"""Dynamic dims through ExecuTorch's Vulkan lowering: one of its passes kept from fixing a dim
at its example size, and a dim fixed anyway refused by name.

ExecuTorch 1.5's Vulkan preprocess runs SqueezeUnsqueezeInputs, which asks of each relu's and
gelu's input shape whether its sizes equal 1 or one another (`shape[0] == shape[1] ==
shape[2] == 1`). Asked of a symbolic size, `==` is a guard: the shape environment answers it
from the size's example (export's example inputs are at the upper bounds) and keeps the answer
as a fact of every graph that shares the environment. A ResNet whose stem has 8 channels,
exported with batch up to 8, gets `batch == 8` answered true: batch becomes 8, and the
serializer then fails on the size node that reads it, now an int ("Cannot create value for node
sym_size with spec of type <class 'int'>"); had no node read it, the artifact would have run at
batch 8 only.

Squeezing serves the native runtime's texture layouts; runtimes/loaders/webgpu's kernels take
any rank. While the lowering runs, the pass squeezes static shapes only and asks nothing of a
symbolic one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from executorch.backends.vulkan._passes.squeeze_unsqueeze_inputs import SqueezeUnsqueezeInputs

from exporter.errors import LoweringFailed

if TYPE_CHECKING:
    from exporter.export import Exported


@contextlib.contextmanager
def kept_dynamic(exported: Exported) -> Iterator[None]:
    """While open, the squeeze pass asks nothing of a symbolic size. A dynamic dim of
    `exported` that the lowering fixes anyway fails it (LoweringFailed, naming the dim and the
    size), whether the lowering went on to fail or not."""
    sizes = dim_sizes(exported)
    original = SqueezeUnsqueezeInputs.should_squeeze

    def should_squeeze(self: SqueezeUnsqueezeInputs, op: Any, shape: Sequence[Any]) -> bool:
        return all(isinstance(size, int) for size in shape) and original(self, op, shape)

    SqueezeUnsqueezeInputs.should_squeeze = should_squeeze
    try:
        yield
    except Exception as error:
        refuse_fixed(sizes, error)
        raise
    finally:
        SqueezeUnsqueezeInputs.should_squeeze = original
    refuse_fixed(sizes)


def dim_sizes(exported: Exported) -> dict[str, torch.SymInt]:
    """Each dynamic dim's symbolic size, by the dim's name, as the program's inputs hold it."""
    program = exported.program
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    sizes: dict[str, torch.SymInt] = {}
    for profile, name in zip(exported.inputs, program.graph_signature.user_inputs, strict=False):
        value = placeholders[name].meta.get("val")
        for axis, dim in profile.dims.items():
            size = value.shape[axis]
            if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                sizes.setdefault(dim, size)
    return sizes


def refuse_fixed(sizes: dict[str, torch.SymInt], cause: BaseException | None = None) -> None:
    """Raises LoweringFailed where one of `sizes` has become a number since dim_sizes."""
    # A symbolic size's expression follows the replacements its shape environment has made
    # since, so a guard's fact shows as a number.
    fixed = {dim: int(size.node.expr) for dim, size in sizes.items() if size.node.expr.is_number}
    if not fixed:
        return
    named = ", ".join(f"{dim} at {value}" for dim, value in fixed.items())
    static = " ".join(f"dynamic.{d}.min={v} dynamic.{d}.max={v}" for d, v in fixed.items())
    raise LoweringFailed(
        f"ExecuTorch's WebGPU lowering fixed dynamic {named}: one of its passes compared a "
        "symbolic size with a number, which torch answers from export's example (the upper "
        "bounds) and keeps as a fact, so the artifact would run at that size only. Declare the "
        f"dim static ({static}), or lower with another backend (backend=executorch)."
    ) from cause
