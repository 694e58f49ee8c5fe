"""Any local Hugging Face causal-LM, encoder-only text, image-classification, Whisper or SmolVLM
checkpoint, through transformers' own classes: a causal LM's token ids [1, seq] -> logits
[1, seq, vocab] (exporter/models/causal_lm.py), an encoder's token ids and attention mask
[batch, seq] -> masked-LM logits or its last hidden state (exporter/models/hf_encoder.py), an
image classifier's pixel values [batch, channels, height, width] -> class logits
(exporter/models/hf_image.py), Whisper's decoder tokens after an encode method read a clip
(exporter/models/hf_speech.py), SmolVLM's tokens after one read an image
(exporter/models/hf_vision_lm.py), as the checkpoint's architecture says. A save_pretrained()
directory or a GGUF file (causal LMs alone), whose weights transformers dequantizes into the
float model. Local files only, never remote code."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    AutoModelForSpeechSeq2Seq,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING,
    MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    MODEL_MAPPING,
    MODEL_MAPPING_NAMES,
)

from exporter.config import HfConfig, KvCache, hf_checkpoint
from exporter.config.hf_checkpoint import HfTask
from exporter.errors import ConfigError
from exporter.models import gguf_codes
from exporter.models.bundle import ModelDeclaration, torch_dtype
from exporter.models.causal_lm import cache_slots, declare_causal_lm
from exporter.models.hf_encoder import declare_encoder
from exporter.models.hf_image import declare_image_classifier
from exporter.models.hf_speech import declare_speech_recognizer
from exporter.models.hf_vision_lm import declare_vision_lm

# transformers' tables of the classes that say a checkpoint's task, as hf_checkpoint reads them
# as text when the job is composed.
_TASK_TABLES = hf_checkpoint.TaskTables(
    causal_lms=MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    masked_lms=MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    headless=MODEL_MAPPING_NAMES,
    encoder_decoders=MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    image_classifiers=MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    speech_recognizers=MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    vision_lms=MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)
# The Auto class that loads each task's weights, and its mapping of config classes to models.
_LOADERS: dict[HfTask, tuple[Any, Mapping[type, type[PreTrainedModel]]]] = {
    HfTask.causal_lm: (AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING),
    HfTask.masked_lm: (AutoModelForMaskedLM, MODEL_FOR_MASKED_LM_MAPPING),
    HfTask.encoder: (AutoModel, MODEL_MAPPING),
    HfTask.image_classification: (
        AutoModelForImageClassification,
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING,
    ),
    HfTask.speech_recognition: (AutoModelForSpeechSeq2Seq, MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING),
    HfTask.vision_lm: (AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING),
}


def declare(cfg: HfConfig) -> ModelDeclaration:
    checkpoint = Path(cfg.checkpoint)
    config, found = read_config(checkpoint)
    model = load(checkpoint, config, torch_dtype(cfg.dtype), found)
    # GPT-2's n_positions answers to this name too, through its config's attribute_map; a
    # config without it (no learned or bounded positions) leaves seq to dynamic's bounds alone.
    max_positions = getattr(config, "max_position_embeddings", None)
    if found in (HfTask.speech_recognition, HfTask.vision_lm):
        slots = cache_slots(cfg)
        if slots is None:
            # Refused at compose too (exporter/config/inputs.py), for a schema built without it.
            raise ConfigError(
                f"model.checkpoint={checkpoint} is {found.kind}, whose decoder runs with a "
                "static KV cache: add model.kv_cache=static."
            )
        tokenizer = functools.partial(load_tokenizer, checkpoint)
        if found is HfTask.vision_lm:
            return declare_vision_lm(model, checkpoint, slots, tokenizer)
        return declare_speech_recognizer(model, checkpoint, slots, tokenizer)
    if found is not HfTask.causal_lm:
        # Refused at compose too (exporter/config/inputs.py), but not for a schema built
        # without it, which would otherwise export an encoder that ignores the setting.
        if cfg.kv_cache is KvCache.static:
            architecture = hf_checkpoint.Architecture(found, config.model_type)
            raise architecture.causal_only("model.kv_cache=static", checkpoint)
        if found is HfTask.image_classification:
            return declare_image_classifier(model, checkpoint)
        return declare_encoder(model, found, max_positions)
    declaration = declare_causal_lm(
        model, max_positions, cache_slots(cfg), functools.partial(load_tokenizer, checkpoint)
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


def read_config(checkpoint: Path) -> tuple[PretrainedConfig, HfTask]:
    """The checkpoint's config and what its architecture computes, refused unless transformers
    itself implements it as a causal LM, an encoder-only text model or an image classifier.

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
    # Again with transformers' own tables, where the composed check read them as text.
    saved_as = config.architectures or []
    return config, hf_checkpoint.task_of(checkpoint, config.model_type, saved_as, _TASK_TABLES)


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
            f"model.checkpoint={checkpoint}: transformers cannot load its tokenizer, which "
            f"validate.prompt and quantize.eval_text encode text with: {error}"
        ) from error


def load(
    checkpoint: Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    task: HfTask = HfTask.causal_lm,
) -> PreTrainedModel:
    """The checkpoint's weights in transformers' class for `config` and `task`, read at `dtype`
    directly: a large model never exists in float32 first."""
    # Attention named rather than left to transformers' choice, so that nothing installed and
    # no attn_implementation in config.json (flash-attention kernels, fetched from the Hub and
    # not exportable) can change the program. sdpa is one op and exports with a dynamic seq for
    # every architecture tested; a class without it (Gemma2, Bloom, GPT-Neo) gets eager, the
    # matmul-softmax attention every class has, which exports too. BERT's sdpa, with its padding
    # mask, exports with dynamic batch and seq and lowers to XNNPACK (its NaN guard and the
    # mask's ops stay on ExecuTorch's CPU kernels), so encoders take the same rule.
    auto, classes = _LOADERS[task]
    supports_sdpa = classes[type(config)]._supports_sdpa
    directory, gguf = _sources(checkpoint)
    if gguf:
        # Every weight dequantized into plain float layers: with the `kernels` package
        # installed, transformers would otherwise keep them packed in its GGUF layers, whose
        # matmul kernels come from the Hub and do not export.
        gguf["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model, info = auto.from_pretrained(
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
