"""A Llama decoder from transformers: token ids [1, seq] -> logits [1, seq, vocab]."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM

from exporter.config import LlamaConfig
from exporter.errors import ConfigError
from exporter.models import hf
from exporter.models.bundle import ModelDeclaration, torch_dtype
from exporter.models.causal_lm import cache_slots, declare_causal_lm


def declare(cfg: LlamaConfig) -> ModelDeclaration:
    dtype = torch_dtype(cfg.dtype)
    if not cfg.checkpoint:
        model = _random_model(cfg, dtype)
        return declare_causal_lm(model, model.config.max_position_embeddings, cache_slots(cfg))
    checkpoint = Path(cfg.checkpoint)
    model = _load_checkpoint(checkpoint, dtype)
    tokenizer = functools.partial(hf.load_tokenizer, checkpoint)
    declaration = declare_causal_lm(
        model, model.config.max_position_embeddings, cache_slots(cfg), tokenizer
    )
    return hf.with_file_quantization(declaration, checkpoint, model)


def _random_model(cfg: LlamaConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    hf_config = HfLlamaConfig(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    # Made at the dtype: a float32 model cast afterwards would hold both copies at once.
    with _default_dtype(dtype):
        return LlamaForCausalLM(hf_config).eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _load_checkpoint(checkpoint: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """A local Llama checkpoint; any other causal LM is model=hf's."""
    # A llama checkpoint that read_config takes is a causal LM: it refuses a headless one.
    config, _ = hf.read_config(checkpoint)
    if config.model_type != "llama":
        raise ConfigError(
            f"model.checkpoint={checkpoint}: model_type is {config.model_type!r}; model=llama "
            f"loads 'llama' checkpoints. Use model=hf model.checkpoint={checkpoint} for any "
            "causal LM transformers implements."
        )
    return hf.load(checkpoint, config, dtype)
