"""A model for `model=custom model.factory=tests.webgpu_models:leaky_relu_mlp`: an MLP whose
leaky_relu ExecuTorch's WebGPU partitioner delegates and this project's WebGPU runtime has no
kernel for, so that the lowering must keep it on the CPU between two delegates."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from exporter.models import ModelDeclaration

HIDDEN = 16


class LeakyReluMlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.leaky_relu(self.up(x), 0.1))


def leaky_relu_mlp() -> ModelDeclaration:
    torch.manual_seed(0)

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["batch"], HIDDEN, generator=generator),)

    return ModelDeclaration(
        module=LeakyReluMlp().eval(),
        input_names=("x",),
        output_names=("y",),
        dim_axes={"batch": (("x", 0),)},
        dim_limits={},
        make_inputs=make_inputs,
    )
