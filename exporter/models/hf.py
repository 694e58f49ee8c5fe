"""Any local Hugging Face causal-LM checkpoint, through transformers' own classes: token ids
[1, seq] -> logits [1, seq, vocab]. A save_pretrained() directory or a GGUF file, whose weights
transformers dequantizes into the float model. Local files only, never remote code."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from exporter.config import HfConfig, hf_checkpoint
from exporter.errors import ConfigError
from exporter.models import gguf_codes
from exporter.models.bundle import ModelDeclaration, torch_dtype
from exporter.models.causal_lm import cache_slots, declare_causal_lm


def declare(cfg: HfConfig) -> ModelDeclaration:
    checkpoint = Path(cfg.checkpoint)
    config = read_config(checkpoint)
    model = load(checkpoint, config, torch_dtype(cfg.dtype))
    # GPT-2's n_positions answers to this name too, through its config's attribute_map; a
    # config without it (no learned or bounded positions) leaves seq to dynamic's bounds alone.
    declaration = declare_causal_lm(
        model,
        getattr(config, "max_position_embeddings", None),
        cache_slots(cfg),
        functools.partial(load_tokenizer, checkpoint),
    )
    return with_file_quantization(declaration, checkpoint, model)


def with_file_quantization(
    declaration: ModelDeclaration, checkpoint: Path, model: PreTrainedModel
) -> ModelDeclaration:
    """The declaration of a GGUF checkpoint's model with what reads its quantized codes
    (exporter/models/gguf_codes.py), for quantize=auto to carry; else unchanged."""
    gguf = hf_checkpoint.gguf_file(checkpoint)
    if gguf is None:
        return declaration
    return dataclasses.replace(
        declaration, file_quantization=functools.partial(gguf_codes.read, gguf, model)
    )


def read_config(checkpoint: Path) -> PretrainedConfig:
    """The checkpoint's config, refused unless transformers itself implements it as a causal LM.

    Checked before any weights are read, so a wrong checkpoint fails in a second; its
    config.json or GGUF header was checked when the job was composed
    (exporter/config/hf_checkpoint.py)."""
    hf_checkpoint.check(checkpoint)
    directory, gguf = _sources(checkpoint)
    # A known model_type with an auto_map as well loads transformers' own class: with
    # trust_remote_code=False, the Auto classes ignore the checkpoint's code.
    try:
        config = AutoConfig.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False, **gguf
        )
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"model.checkpoint={checkpoint}: cannot read its config: {error}"
        ) from error
    # Again with transformers' own classes, where the composed check read their tables as text.
    saved_as = config.architectures or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or (
        saved_as and not causal.intersection(saved_as)
    ):
        raise ConfigError(hf_checkpoint.no_causal_lm_head(checkpoint, config.model_type, saved_as))
    return config


def _sources(checkpoint: Path) -> tuple[Path, dict[str, Any]]:
    """The directory transformers reads `checkpoint` from, and the GGUF file in it that it names
    (as from_pretrained's gguf_file), if it is one."""
    gguf = hf_checkpoint.gguf_file(checkpoint)
    if gguf is None:
        return checkpoint, {}
    return gguf.parent, {"gguf_file": gguf.name}


def load_tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer: its save_pretrained() files, or the vocabulary and chat
    template a GGUF file carries."""
    directory, gguf = _sources(checkpoint)
    try:
        return AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False, **gguf
        )
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(
            f"model.checkpoint={checkpoint}: validate.prompt needs its tokenizer, which "
            f"transformers cannot load: {error}"
        ) from error


def load(checkpoint: Path, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The checkpoint's weights in transformers' class for `config`, read at `dtype` directly: a
    large model never exists in float32 first."""
    # Attention named rather than left to transformers' choice, so that nothing installed and
    # no attn_implementation in config.json (flash-attention kernels, fetched from the Hub and
    # not exportable) can change the program. sdpa is one op and exports with a dynamic seq for
    # every architecture tested; a class without it (Gemma2, Bloom, GPT-Neo) gets eager, the
    # matmul-softmax attention every class has, which exports too.
    supports_sdpa = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa
    directory, gguf = _sources(checkpoint)
    if gguf:
        # Every weight dequantized into plain float layers: with the `kernels` package
        # installed, transformers would otherwise keep them packed in its GGUF layers, whose
        # matmul kernels come from the Hub and do not export.
        gguf["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            local_files_only=True,
            trust_remote_code=False,
            dtype=dtype,
            attn_implementation="sdpa" if supports_sdpa else "eager",
            output_loading_info=True,
            **gguf,
        )
    except pickle.UnpicklingError as error:
        # torch's safe loader (weights_only) refused a name the composed check lets through (one
        # of torch's own); its message advises weights_only=False, which would run the file.
        files = ", ".join(path.name for path in hf_checkpoint.weight_files(directory))
        raise ConfigError(
            f"model.checkpoint={checkpoint}: refused {files}: unpickling it would run code that "
            "torch's safe loader does not allow; model=hf loads weights, never code. Use the "
            "checkpoint's safetensors weights (model.safetensors) instead."
        ) from error
    except (OSError, ValueError, RuntimeError) as error:
        raise ConfigError(
            f"model.checkpoint={checkpoint}: cannot load its weights: {error}"
        ) from error
    # transformers fills a tensor the files lack with random values and only warns (one they
    # hold at another shape raises, above): that would export and validate a model nobody
    # trained.
    missing = sorted(info["missing_keys"])
    if missing:
        raise ConfigError(
            f"model.checkpoint={checkpoint}: its weights lack {len(missing)} of the model's "
            f"tensors ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "transformers would draw them at random."
        )
    return model.eval()
