"""The declaration shared by models over rows of tokens: x [tokens, features] -> same shape."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from exporter.models.bundle import ModelDeclaration


def declare_over_tokens(module: torch.nn.Module, features: int) -> ModelDeclaration:
    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["tokens"], features, generator=generator),)

    return ModelDeclaration(
        module=module.eval(),
        input_names=("x",),
        output_names=("y",),
        dim_axes={"tokens": (("x", 0),)},
        dim_limits={},
        make_inputs=make_inputs,
    )
