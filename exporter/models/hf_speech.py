"""Whisper as one module with two methods over shared state: `encode` fills each decoder layer's
cross-attention keys and values from the encoder's reading of a clip's log-mel features,
`forward` runs decoder tokens at cache positions with a static self-attention cache, as
StaticCacheLM does for causal LMs. Both keep their state in buffers, so the two programs
exported from one instance name it alike, and a runtime that ties them (AOTInductor's package
of both, the eager loader) has the decoder read what encode wrote. The oracle is transformers'
own model in float64 (WhisperLogits), which shares no code with the cache.

The sessions' clips are tones drawn from a seed, turned into features as a target turns a WAV
file into them (runtimes/audio.py): features of audio's own range and structure, not noise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import WhisperForConditionalGeneration

from exporter.errors import ConfigError
from exporter.models.bundle import Decoder, Encoding, ModelDeclaration, encode_as_forward
from exporter.models.causal_lm import declare_cached, eos_ids
from runtimes import audio

# What save_pretrained() writes of a model's generation config.
GENERATION_CONFIG = "generation_config.json"
# A session's clip: this many seconds of tones, the rest of Whisper's 30 s window silence.
_CLIP_SECONDS = 3


class WhisperCacheLM(torch.nn.Module):
    """`encode(input_features)` and `forward(input_ids, cache_position) -> logits` over the
    cross-attention and self-attention caches, buffers of `slots` positions for the latter."""

    def __init__(self, model: WhisperForConditionalGeneration, slots: int) -> None:
        super().__init__()
        config = model.config
        self.model = model
        self.slots = slots
        self.heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.heads
        frames = config.max_source_positions
        dtype = model.dtype
        for layer in range(config.decoder_layers):
            for name, length in (
                ("cross_keys", frames),
                ("cross_values", frames),
                ("keys", slots),
                ("values", slots),
            ):
                shape = (1, self.heads, length, self.head_dim)
                self.register_buffer(
                    f"{name}_{layer}", torch.zeros(shape, dtype=dtype), persistent=False
                )

    def _split(self, states: torch.Tensor) -> torch.Tensor:
        return states.view(1, -1, self.heads, self.head_dim).transpose(1, 2)

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """The encoder's states of one clip, its keys and values written for every layer's
        cross-attention. The features come in float32, as a target computes them, whatever the
        model's dtype."""
        features = input_features.to(self.model.dtype)
        states = self.model.model.encoder(features).last_hidden_state
        for index, layer in enumerate(self.model.model.decoder.layers):
            attention = layer.encoder_attn
            getattr(self, f"cross_keys_{index}").copy_(self._split(attention.k_proj(states)))
            getattr(self, f"cross_values_{index}").copy_(self._split(attention.v_proj(states)))
        return states

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        decoder = self.model.model.decoder
        seq = input_ids.shape[1]
        hidden = decoder.embed_tokens(input_ids) + decoder.embed_positions.weight[cache_position]
        # Each query sees the slots up to its own position.
        visible = (
            torch.arange(self.slots, device=input_ids.device)[None, :] <= cache_position[:, None]
        )
        for index, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            normed = layer.self_attn_layer_norm(hidden)
            # Whisper scales the queries before the product (transformers' WhisperAttention).
            query = self._split(attention.q_proj(normed) * attention.scaling)
            keys, values = getattr(self, f"keys_{index}"), getattr(self, f"values_{index}")
            keys.index_copy_(2, cache_position, self._split(attention.k_proj(normed)))
            values.index_copy_(2, cache_position, self._split(attention.v_proj(normed)))
            attended = scaled_dot_product_attention(
                query, keys, values, attn_mask=visible, scale=1.0
            )
            hidden = hidden + attention.out_proj(attended.transpose(1, 2).reshape(1, seq, -1))
            cross = layer.encoder_attn
            query = self._split(cross.q_proj(layer.encoder_attn_layer_norm(hidden)) * cross.scaling)
            attended = scaled_dot_product_attention(
                query,
                getattr(self, f"cross_keys_{index}"),
                getattr(self, f"cross_values_{index}"),
                scale=1.0,
            )
            hidden = hidden + cross.out_proj(attended.transpose(1, 2).reshape(1, seq, -1))
            normed = layer.final_layer_norm(hidden)
            hidden = hidden + layer.fc2(layer.activation_fn(layer.fc1(normed)))
        return self.model.proj_out(decoder.layer_norm(hidden))


class WhisperLogits(torch.nn.Module):
    """transformers' Whisper without a cache: decoder token ids [1, n] and a clip's features ->
    the logits of every position."""

    def __init__(self, model: WhisperForConditionalGeneration) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, input_features: torch.Tensor) -> torch.Tensor:
        return self.model(input_features=input_features, decoder_input_ids=input_ids).logits


def tones(seed: int) -> np.ndarray:
    """A clip of 16 kHz samples: a few tones of seeded pitch and length in a row."""
    rng = np.random.default_rng(seed)
    samples = []
    left = _CLIP_SECONDS * audio.SAMPLE_RATE
    while left > 0:
        length = min(left, int(rng.uniform(0.2, 0.8) * audio.SAMPLE_RATE))
        time = np.arange(length) / audio.SAMPLE_RATE
        pitch = rng.uniform(150.0, 2000.0)
        samples.append(0.3 * np.sin(2 * math.pi * pitch * time))
        left -= length
    return np.concatenate(samples).astype(np.float32)


def prompt_of(model: WhisperForConditionalGeneration, checkpoint: Path) -> tuple[int, ...]:
    """The tokens a transcription starts from: the start of transcript, then English and
    transcribe where the model is multilingual, then no timestamps, as the checkpoint's
    generation_config.json gives their ids (transformers 5 keeps none of Whisper's keys when it
    reads the file, so it is read here as the JSON it is)."""
    file = checkpoint / GENERATION_CONFIG
    generation = json.loads(file.read_text()) if file.is_file() else {}
    prompt = [model.config.decoder_start_token_id]
    try:
        if generation.get("is_multilingual"):
            prompt += [generation["lang_to_id"]["<|en|>"], generation["task_to_id"]["transcribe"]]
        if "no_timestamps_token_id" in generation:
            prompt.append(int(generation["no_timestamps_token_id"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(
            f"{file}: a multilingual Whisper's lang_to_id and task_to_id must name <|en|> and "
            f"transcribe, and no_timestamps_token_id must be an id ({error!r})"
        ) from error
    return tuple(prompt)


def declare_speech_recognizer(
    model: WhisperForConditionalGeneration,
    checkpoint: Path,
    max_cache_len: int,
    tokenizer: Callable[[], Any] | None = None,
) -> ModelDeclaration:
    """Whisper behind WhisperCacheLM with `max_cache_len` slots: its decoder's token ids and
    cache positions are the program's inputs, its encode method a second program (Encoding)."""
    config = model.config
    if max_cache_len > config.max_target_positions:
        raise ConfigError(
            f"model.max_cache_len is {max_cache_len}, beyond the decoder's "
            f"{config.max_target_positions} positions; allowed: 2..{config.max_target_positions}."
        )
    module = WhisperCacheLM(model, max_cache_len).eval()

    def make_clip(seed: int) -> torch.Tensor:
        features = audio.log_mel(tones(seed), config.num_mel_bins)
        return torch.from_numpy(features).unsqueeze(0)

    clip_shape = (1, config.num_mel_bins, audio.FRAMES)

    return declare_cached(
        module,
        Decoder(
            max_cache_len=max_cache_len,
            vocab_size=config.vocab_size,
            layers=config.decoder_layers,
            uncached=WhisperLogits(model).eval(),
            bos_id=config.decoder_start_token_id,
            eos_ids=eos_ids(model),
            tokenizer=tokenizer,
            encoding=Encoding(
                encode_as_forward(module),
                "input_features",
                clip_shape,
                make_clip,
                prompt_of(model, checkpoint),
            ),
        ),
    )
