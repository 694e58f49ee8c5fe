"""What transformers' causal LMs share: token ids [1, seq] -> logits [1, seq, vocab]."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import PreTrainedModel

from exporter.models.bundle import ModelDeclaration


class LogitsOnly(torch.nn.Module):
    """Token ids in, logits out, no KV cache: the signature export and every runtime see."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def declare_causal_lm(model: PreTrainedModel, max_positions: int | None) -> ModelDeclaration:
    """`model` behind LogitsOnly, fed token ids drawn from its vocabulary; `max_positions` bounds
    `seq` (None: the model sets no limit of its own)."""
    vocab_size = model.config.vocab_size

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab_size, (1, sizes["seq"]), generator=generator),)

    return ModelDeclaration(
        module=LogitsOnly(model).eval(),
        input_names=("input_ids",),
        output_names=("logits",),
        dim_axes={"seq": (("input_ids", 1),)},
        dim_limits={} if max_positions is None else {"seq": max_positions},
        make_inputs=make_inputs,
        logits_outputs=("logits",),
    )
