"""SmolVLM as one module with two methods over shared state: `encode` reads an image with the
vision tower and the connector and keeps its features, a row per image token, in a buffer;
`forward` runs token ids at cache positions with a static KV cache, as StaticCacheLM does for
causal LMs, each image token's embedding replaced by the next row of those features, in order,
whichever call it comes in (a prompt's prefill, or one token at a time). The oracle is
transformers' own model in float64 (VisionLanguageLogits), which shares no code with the cache.

The sessions' images are drawn from a seed: smooth fields of colour in the vision tower's range
after its processor's normalization, not noise.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

from exporter.errors import ConfigError
from exporter.models.bundle import Decoder, Encoding, ModelDeclaration, encode_as_forward
from exporter.models.causal_lm import StaticCacheLM, declare_cached, eos_ids
from runtimes.classification import PROCESSOR_FILE

# A session's image: a field of this many smooth blobs of colour.
_BLOBS = 4


class VisionLanguageCacheLM(StaticCacheLM):
    """`encode(pixel_values)` and `forward(input_ids, cache_position) -> logits`: the image's
    features and how many of them the calls since `encode` have read are buffers, beside the
    static cache's."""

    def __init__(self, model: PreTrainedModel, slots: int) -> None:
        super().__init__(model, slots)
        config = model.config
        self.image_token_id = config.image_token_id
        rows = model.model.image_seq_len
        hidden = config.text_config.hidden_size
        self.register_buffer(
            "image_features", torch.zeros(rows, hidden, dtype=model.dtype), persistent=False
        )
        self.register_buffer("image_rows_read", torch.zeros(1, dtype=torch.long), persistent=False)

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The features of one image [1, channels, size, size], normalized as the checkpoint's
        processor does, kept for the image tokens to come. The whole image is patches, so each
        patch's position is its index (transformers computes it from a mask of real patches)."""
        vlm = self.model.model
        vision = vlm.vision_model
        values = pixel_values.to(self.model.dtype)
        patches = vision.embeddings.patch_embedding(values).flatten(2).transpose(1, 2)
        states = vision.encoder(inputs_embeds=patches + vision.embeddings.position_embedding.weight)
        features = vlm.connector(vision.post_layernorm(states.last_hidden_state))[0]
        self.image_features.copy_(features)
        self.image_rows_read.zero_()
        return features

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        embedded = self.model.get_input_embeddings()(input_ids)
        placed = input_ids == self.image_token_id
        row = self.image_rows_read + torch.cumsum(placed, dim=-1) - 1
        # An image token past the image's rows (one a generation emits) keeps its embedding.
        placed = placed & (row < self.image_features.shape[0])
        features = self.image_features[row.clamp(0, self.image_features.shape[0] - 1)]
        embedded = torch.where(placed[..., None], features, embedded)
        self.image_rows_read.add_(placed.sum())
        return TorchExportableModuleWithStaticCache.forward(
            self, inputs_embeds=embedded, cache_position=cache_position
        )


class VisionLanguageLogits(torch.nn.Module):
    """transformers' SmolVLM without a cache: token ids [1, n] and an image's pixel values ->
    the logits of every position, the first image tokens (as many as the image has features)
    standing for the image; any after them keep their embedding, as the cache's module does."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        vlm = self.model.model
        # Not get_image_features, which casts the pixels to the model's dtype: the oracle
        # computes in float64 throughout.
        states = vlm.vision_model(pixel_values=pixel_values).last_hidden_state
        features = vlm.connector(states)[0]
        embedded = vlm.get_input_embeddings()(input_ids)
        placed = torch.nonzero(input_ids[0] == self.model.config.image_token_id).flatten()
        placed = placed[: features.shape[0]]
        embedded[0, placed] = features[: placed.numel()].to(embedded.dtype)
        return self.model(inputs_embeds=embedded).logits


def blobs(seed: int, size: int, channels: int) -> torch.Tensor:
    """An image [1, channels, size, size] in [-1, 1]: a few Gaussian blobs of seeded colour,
    place and width over a seeded background."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.linspace(0.0, 1.0, size)
    y, x = grid[:, None], grid[None, :]
    image = torch.rand(channels, 1, 1, generator=generator).expand(channels, size, size).clone()
    for _ in range(_BLOBS):
        centre = torch.rand(2, generator=generator)
        width = 0.05 + 0.2 * float(torch.rand(1, generator=generator))
        weight = torch.exp(-((y - centre[0]) ** 2 + (x - centre[1]) ** 2) / (2 * width**2))
        colour = torch.rand(channels, 1, 1, generator=generator)
        image = image * (1 - weight) + colour * weight
    return (image * 2 - 1).unsqueeze(0)


def declare_vision_lm(
    model: PreTrainedModel,
    checkpoint: Path,
    max_cache_len: int,
    tokenizer: Callable[[], Any] | None = None,
) -> ModelDeclaration:
    """SmolVLM behind VisionLanguageCacheLM with `max_cache_len` slots: its token ids and cache
    positions are the program's inputs, its encode method a second program (Encoding), whose
    image tokens the sessions place after their first token. The checkpoint's image processor
    settings go into the bundle, where it has them (runtimes/pixels.py reads them)."""
    config = model.config
    text = config.text_config
    if max_cache_len > text.max_position_embeddings:
        raise ConfigError(
            f"model.max_cache_len is {max_cache_len}, beyond the language model's "
            f"{text.max_position_embeddings} positions; allowed: 2..{text.max_position_embeddings}."
        )
    rows = model.model.image_seq_len
    if max_cache_len < rows + 2:
        raise ConfigError(
            f"model.max_cache_len is {max_cache_len}, and an image is {rows} tokens: the cache "
            f"needs at least {rows + 2} slots to hold one and a token either side."
        )
    module = VisionLanguageCacheLM(model, max_cache_len).eval()
    vision = config.vision_config
    image_shape = (1, vision.num_channels, vision.image_size, vision.image_size)
    image_tokens = (config.image_token_id,) * rows
    bos = text.bos_token_id
    declaration = declare_cached(
        module,
        Decoder(
            max_cache_len=max_cache_len,
            vocab_size=text.vocab_size,
            layers=text.num_hidden_layers,
            uncached=VisionLanguageLogits(model).eval(),
            bos_id=bos,
            eos_ids=eos_ids(model),
            tokenizer=tokenizer,
            encoding=Encoding(
                encode_as_forward(module),
                "pixel_values",
                image_shape,
                lambda seed: blobs(seed, vision.image_size, vision.num_channels),
                (*([] if bos is None else [bos]), *image_tokens),
                image_tokens,
            ),
        ),
    )
    settings = checkpoint / PROCESSOR_FILE
    if not settings.is_file():
        return declaration

    def write(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(settings, folder / settings.name)

    return dataclasses.replace(declaration, preprocessor=write)
