"""A model for `model=custom model.factory=tests.gelu_models:tanh_gelu_mlp`: a Gemma-style MLP
block (up projection, tanh-GELU, down projection) whose pre-activations are of order 1 to 4,
where XNNPACK's exact GELU and the tanh-GELU asked for differ by up to 4.7e-4."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from exporter.models import ModelDeclaration

HIDDEN = 16
INTERMEDIATE = 64


class TanhGeluMlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, INTERMEDIATE)
        self.down = torch.nn.Linear(INTERMEDIATE, HIDDEN)
        with torch.no_grad():
            # Unit-variance inputs give pre-activations of standard deviation about 2.
            self.up.weight.normal_(0.0, 2.0 / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x), approximate="tanh"))


def tanh_gelu_mlp() -> ModelDeclaration:
    torch.manual_seed(0)

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["batch"], HIDDEN, generator=generator),)

    return ModelDeclaration(
        module=TanhGeluMlp().eval(),
        input_names=("x",),
        output_names=("y",),
        dim_axes={"batch": (("x", 0),)},
        dim_limits={},
        make_inputs=make_inputs,
    )
