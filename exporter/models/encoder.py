"""A transformer encoder block: x [batch, seq, features] -> [batch, seq, features].

Pre-norm single-head self-attention without a mask, then a pre-norm MLP, each added to its
input. Its two dynamic dims meet in the attention scores [batch, seq, seq], so a backend that
sizes a kernel by one dim and indexes it by the other fails at the plan's mixed corners
(batch=max with seq=min), which a model of one dim cannot reach.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from exporter.config import EncoderConfig
from exporter.models.bundle import ModelDeclaration


class EncoderBlock(torch.nn.Module):
    """Attention is written with bmm and softmax: scaled_dot_product_attention's decomposition
    adds a NaN guard (any, where, full_like) and matmul an expand and a view over the dynamic
    dims, none of which XNNPACK takes; this way only the two LayerNorms stay off the delegate."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.scale = 1 / math.sqrt(cfg.features)
        self.attention_norm = torch.nn.LayerNorm(cfg.features)
        self.q = torch.nn.Linear(cfg.features, cfg.features)
        self.k = torch.nn.Linear(cfg.features, cfg.features)
        self.v = torch.nn.Linear(cfg.features, cfg.features)
        self.out = torch.nn.Linear(cfg.features, cfg.features)
        self.mlp_norm = torch.nn.LayerNorm(cfg.features)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(cfg.features, cfg.hidden_features),
            torch.nn.GELU(),
            torch.nn.Linear(cfg.hidden_features, cfg.features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        scores = torch.bmm(self.q(h), self.k(h).transpose(1, 2)) * self.scale
        x = x + self.out(torch.bmm(scores.softmax(dim=-1), self.v(h)))
        return x + self.mlp(self.mlp_norm(x))


def declare(cfg: EncoderConfig) -> ModelDeclaration:
    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        shape = (sizes["batch"], sizes["seq"], cfg.features)
        return (torch.randn(shape, generator=generator),)

    return ModelDeclaration(
        module=EncoderBlock(cfg).eval(),
        input_names=("x",),
        output_names=("y",),
        dim_axes={"batch": (("x", 0),), "seq": (("x", 1),)},
        dim_limits={},
        make_inputs=make_inputs,
    )
