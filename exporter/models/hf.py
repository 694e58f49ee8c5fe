"""Any local Hugging Face causal-LM checkpoint, through transformers' own classes: token ids
[1, seq] -> logits [1, seq, vocab]. Local files only, never remote code."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from exporter.config import HfConfig
from exporter.errors import ConfigError
from exporter.models.bundle import ModelDeclaration, torch_dtype
from exporter.models.causal_lm import declare_causal_lm


def declare(cfg: HfConfig) -> ModelDeclaration:
    directory = Path(cfg.checkpoint)
    config = read_config(directory)
    model = load(directory, config, torch_dtype(cfg.dtype))
    # GPT-2's n_positions answers to this name too, through its config's attribute_map; a
    # config without it (no learned or bounded positions) leaves seq to dynamic's bounds alone.
    return declare_causal_lm(model, getattr(config, "max_position_embeddings", None))


def read_config(directory: Path) -> PretrainedConfig:
    """The checkpoint's config, refused unless transformers itself implements it as a causal LM.

    Checked before any weights are read, so a wrong checkpoint fails in a second."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.checkpoint={directory}: not a Hugging Face checkpoint (no config.json); "
            "point it at a directory written by save_pretrained()."
        )
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as error:
        raise ConfigError(
            f"model.checkpoint={directory}: config.json is not JSON: {error}"
        ) from error
    model_type = raw.get("model_type")
    # Read from the file rather than left to AutoConfig, whose answer for these is an offer to
    # run the checkpoint's own Python (trust_remote_code=True) or to upgrade from the network.
    if model_type not in CONFIG_MAPPING:
        why = (
            "its config.json maps it to code shipped with the checkpoint (auto_map)"
            if "auto_map" in raw
            else "it would need code shipped with the checkpoint or another transformers"
        )
        raise ConfigError(
            f"model.checkpoint={directory}: model_type {model_type!r} is not one transformers "
            f"{transformers.__version__} implements; {why}, and model=hf refuses remote code "
            "(trust_remote_code=False). Use a checkpoint of an architecture transformers ships."
        )
    # A known model_type with an auto_map as well loads transformers' own class: with
    # trust_remote_code=False, the Auto classes ignore the checkpoint's code.
    try:
        config = AutoConfig.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"model.checkpoint={directory}: cannot read its config: {error}"
        ) from error
    _check_causal_lm(directory, config)
    return config


def _check_causal_lm(directory: Path, config: PretrainedConfig) -> None:
    # AutoModelForCausalLM maps some encoders too (bert -> BertLMHeadModel); the architecture the
    # checkpoint was saved from says whether its weights hold a causal-LM head, or whether one
    # would be drawn at random.
    saved_as = config.architectures or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or (
        saved_as and not causal.intersection(saved_as)
    ):
        architecture = f" (saved as {', '.join(saved_as)})" if saved_as else ""
        raise ConfigError(
            f"model.checkpoint={directory}: model_type {config.model_type!r}{architecture} has "
            "no causal-LM head (an encoder-only, encoder-decoder or headless model); model=hf "
            "exports causal LMs, the checkpoints AutoModelForCausalLM loads."
        )


def load(directory: Path, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The checkpoint's weights in transformers' class for `config`, read at `dtype` directly: a
    large model never exists in float32 first."""
    # Attention named rather than left to transformers' choice, so that nothing installed and
    # no attn_implementation in config.json (flash-attention kernels, fetched from the Hub and
    # not exportable) can change the program. sdpa is one op and exports with a dynamic seq for
    # every architecture tested; a class without it (Gemma2, Bloom, GPT-Neo) gets eager, the
    # matmul-softmax attention every class has, which exports too.
    supports_sdpa = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            local_files_only=True,
            trust_remote_code=False,
            dtype=dtype,
            attn_implementation="sdpa" if supports_sdpa else "eager",
            output_loading_info=True,
        )
    except (OSError, ValueError, RuntimeError) as error:
        raise ConfigError(
            f"model.checkpoint={directory}: cannot load its weights: {error}"
        ) from error
    # transformers fills a tensor the files lack with random values and only warns (one they
    # hold at another shape raises, above): that would export and validate a model nobody
    # trained.
    missing = sorted(info["missing_keys"])
    if missing:
        raise ConfigError(
            f"model.checkpoint={directory}: its weights lack {len(missing)} of the model's "
            f"tensors ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "transformers would draw them at random."
        )
    return model.eval()
