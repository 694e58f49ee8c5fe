"""What transformers' encoder-only text models share (BERT and its kind): token ids and their
attention mask, each [batch, seq] int64 -> the masked-LM head's logits [batch, seq, vocab], or a
headless encoder's last hidden state [batch, seq, hidden]."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import PreTrainedModel

from exporter.config.hf_checkpoint import HfTask
from exporter.models.bundle import ModelDeclaration

# The one output each task's module returns, by the name of its field in transformers' output.
OUTPUTS = {HfTask.masked_lm: "logits", HfTask.encoder: "last_hidden_state"}


class EncoderOutput(torch.nn.Module):
    """Token ids and attention mask in, one tensor out: the signature export and every runtime
    see, rather than transformers' output object (a headless BERT's holds its pooler's output
    too, which no masked-LM or embedding use reads)."""

    def __init__(self, model: PreTrainedModel, output: str) -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(input_ids=input_ids, attention_mask=attention_mask), self.output)


def declare_encoder(
    model: PreTrainedModel, task: HfTask, max_positions: int | None
) -> ModelDeclaration:
    """`model` behind EncoderOutput, fed token ids drawn from its vocabulary and a padding mask;
    `max_positions` bounds `seq` (None: the model sets no limit of its own)."""
    vocab_size = model.config.vocab_size

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        """A batch padded as a tokenizer pads one: the first row fills seq, each other row keeps
        a drawn count of its first tokens (at least one, so that every query has a key to attend
        to); so the artifact is judged on what the mask masks at every shape."""
        generator = torch.Generator().manual_seed(seed)
        batch, seq = sizes["batch"], sizes["seq"]
        ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
        lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
        lengths[0] = seq
        mask = (torch.arange(seq) < lengths.unsqueeze(1)).to(torch.int64)
        return ids, mask

    output = OUTPUTS[task]
    return ModelDeclaration(
        module=EncoderOutput(model, output).eval(),
        input_names=("input_ids", "attention_mask"),
        output_names=(output,),
        dim_axes={
            "batch": (("input_ids", 0), ("attention_mask", 0)),
            "seq": (("input_ids", 1), ("attention_mask", 1)),
        },
        dim_limits={} if max_positions is None else {"seq": max_positions},
        make_inputs=make_inputs,
        # The masked-LM head's logits are a distribution over the vocabulary at each position,
        # whose predictions (top-1 agreement, KL divergence) validation measures too.
        logits_outputs=("logits",) if task is HfTask.masked_lm else (),
    )
