"""A tiny Llama trained for seconds on the quality text (Python's documentation, a byte per
token), so that its next-token predictions are a trained model's, sharp where random weights
give nearly flat ones; and outlier weight columns planted in it without changing what it
computes, as trained LLMs have them, which per-group rounding of the weights loses."""

from __future__ import annotations

from pydoc_data.topics import topics

import torch
import transformers

from exporter.quantize.quality import DEFAULT_TOPICS
from tests import gguf_checkpoint

# The channel of the hidden state whose weight columns are planted.
CHANNEL = 7


def trained(steps: int = 300, seed: int = 0) -> transformers.LlamaForCausalLM:
    """Two layers of 64 wide, every head its own keys (packed layers take rows in blocks of 64),
    trained with AdamW on random windows of the text."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=gguf_checkpoint.VOCAB_SIZE,
        max_position_embeddings=256,
        bos_token_id=gguf_checkpoint.BOS_ID,
        eos_token_id=gguf_checkpoint.EOS_ID,
    )
    model = transformers.LlamaForCausalLM(config)
    text = "".join(topics[name] for name in DEFAULT_TOPICS).encode()
    data = torch.tensor(list(text), dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 129, (16,), generator=generator)
        batch = torch.stack([data[start : start + 129] for start in starts])
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), batch[:, 1:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def with_outlier_columns(
    model: transformers.LlamaForCausalLM, factor: float
) -> transformers.LlamaForCausalLM:
    """`model` computing the same function with one hidden channel's column of every layer that
    reads a norm's output `factor` times larger (the norm's weight for it `factor` times
    smaller): a group of 32 weights holding one such value rounds the other 31 to a coarse
    grid."""
    with torch.no_grad():
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for norm, readers in (
                (layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj)),
                (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
            ):
                norm.weight[CHANNEL] /= factor
                for linear in readers:
                    linear.weight[:, CHANNEL] *= factor
    return model
