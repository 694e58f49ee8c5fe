"""A Llama decoder from transformers: token ids [1, seq] -> logits [1, seq, vocab]."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM

from exporter.config import LlamaConfig
from exporter.errors import ConfigError
from exporter.models.bundle import ModelDeclaration, torch_dtype


class LogitsOnly(torch.nn.Module):
    """Token ids in, logits out, no KV cache: the signature export and every runtime see."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def declare(cfg: LlamaConfig) -> ModelDeclaration:
    dtype = torch_dtype(cfg.dtype)
    if cfg.checkpoint:
        model = _load_checkpoint(Path(cfg.checkpoint), dtype)
    else:
        model = _random_model(cfg, dtype)
    vocab_size = model.config.vocab_size

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab_size, (1, sizes["seq"]), generator=generator),)

    return ModelDeclaration(
        module=LogitsOnly(model).eval(),
        input_names=("input_ids",),
        output_names=("logits",),
        dim_axes={"seq": (("input_ids", 1),)},
        dim_limits={"seq": model.config.max_position_embeddings},
        make_inputs=make_inputs,
    )


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


def _load_checkpoint(directory: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """Loads a local Hugging Face checkpoint directory; never touches the network."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.checkpoint={directory}: not a Hugging Face checkpoint (no config.json); "
            "point it at a directory written by save_pretrained()."
        )
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"model.checkpoint={directory}: model_type is {model_type!r}; "
            "model=llama loads 'llama' checkpoints."
        )
    try:
        model = LlamaForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.checkpoint={directory}: cannot load it: {error}") from error
    return model.eval()
