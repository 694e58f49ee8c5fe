"""A small MLP: x [batch, in_features] -> [batch, out_features]; the quick model for tests."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from exporter.config import MlpConfig
from exporter.models.bundle import ModelDeclaration


def declare(cfg: MlpConfig) -> ModelDeclaration:
    module = torch.nn.Sequential(
        torch.nn.Linear(cfg.in_features, cfg.hidden_features),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg.hidden_features, cfg.hidden_features),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg.hidden_features, cfg.out_features),
    ).eval()

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["batch"], cfg.in_features, generator=generator),)

    return ModelDeclaration(
        module=module,
        input_names=("x",),
        output_names=("y",),
        dim_axes={"batch": (("x", 0),)},
        dim_limits={},
        make_inputs=make_inputs,
    )
