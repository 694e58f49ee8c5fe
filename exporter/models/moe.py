"""Top-k routed experts: x [tokens, features] -> [tokens, features].

Each expert gathers the tokens the router sent to it, a count known only from the data, runs
its MLP on them and adds the results back, weighted: the data-dependent shapes of every MoE.
"""

from __future__ import annotations

import torch

from exporter.config import MoeConfig
from exporter.models.bundle import ModelDeclaration
from exporter.models.token_rows import declare_over_tokens


class RoutedExperts(torch.nn.Module):
    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = torch.nn.Linear(cfg.features, cfg.experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(cfg.features, cfg.hidden_features),
                torch.nn.SiLU(),
                torch.nn.Linear(cfg.hidden_features, cfg.features),
            )
            for _ in range(cfg.experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            routed = chosen == index
            # view(-1), not nonzero(as_tuple=True) or [:, 0]: ExecuTorch 1.5's portable
            # select/slice/squeeze kernels reject the dim order of nonzero's output.
            tokens = torch.nonzero(routed.any(dim=-1)).view(-1)
            gate = (weights * routed).sum(dim=-1)
            out = out.index_add(0, tokens, expert(x[tokens]) * gate[tokens].unsqueeze(-1))
        return out


def declare(cfg: MoeConfig) -> ModelDeclaration:
    return declare_over_tokens(RoutedExperts(cfg), cfg.features)
