"""Boolean-mask selection: x [tokens, features] -> [tokens, features].

A gate picks rows (x[keep], a count known only from the data); only they go through the MLP and
are written back in place, the others pass through unchanged.
"""

from __future__ import annotations

import torch

from exporter.config import MaskedConfig
from exporter.models.bundle import ModelDeclaration
from exporter.models.token_rows import declare_over_tokens


class MaskedMlp(torch.nn.Module):
    def __init__(self, cfg: MaskedConfig) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(cfg.features, 1)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(cfg.features, cfg.hidden_features),
            torch.nn.ReLU(),
            torch.nn.Linear(cfg.hidden_features, cfg.features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = self.gate(x).squeeze(-1) > 0
        out = x.clone()
        out[keep] = self.mlp(x[keep])
        return out


def declare(cfg: MaskedConfig) -> ModelDeclaration:
    return declare_over_tokens(MaskedMlp(cfg), cfg.features)
