"""Image classification with the artifact of an image classifier: image files read and
preprocessed by the checkpoint's own image processor (resized, cropped, rescaled and normalized as
it was trained with), run as one batch, and each image's most likely labels with their
probabilities (the softmax of its logits).

The image processor and the labels travel in the bundle (`preprocessor/`: the processor's
save_pretrained files and labels.json), so the target needs transformers and Pillow, never the
checkpoint.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtimes import Loaded
from runtimes.verdict.errors import ArtifactFailed

LABELS_FILE = "labels.json"
# What an image processor's save_pretrained() writes, which from_pretrained() reads.
PROCESSOR_FILE = "preprocessor_config.json"


class ImageRefused(Exception):
    """An image or the bundle's image processor that cannot be used; the message says why."""


@dataclass(frozen=True)
class Preprocessor:
    """The checkpoint's image processor and its labels, by class index."""

    processor: Any
    labels: dict[int, str]

    def pixel_values(self, images: Sequence[Path]) -> torch.Tensor:
        """The images as the model takes them: [batch, channels, height, width], float32."""
        opened = [rgb(path) for path in images]
        return self.processor(opened, return_tensors="pt")["pixel_values"].float()


def rgb(path: Path) -> Any:
    """The image file at `path` as a Pillow RGB image; ImageRefused where Pillow reads none."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        raise ImageRefused(f"{path}: not an image Pillow reads ({error})") from error
    except Image.DecompressionBombError as error:
        # More pixels than Pillow decodes unasked: a file made to exhaust memory.
        raise ImageRefused(f"{path}: refused: {error}") from error


def read(folder: Path) -> Preprocessor:
    """The bundle's image processor (`folder`), as transformers reads it without torchvision
    where that is not installed."""
    import logging

    from transformers import AutoImageProcessor

    # Without torchvision transformers falls back to its Pillow processors, and says so at
    # warning level in every run: what a target without torchvision is meant to do.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        processor = AutoImageProcessor.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False
        )
        labels = json.loads((folder / LABELS_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ImageRefused(f"{folder}: the image processor cannot be read: {error}") from error
    if not isinstance(labels, dict) or not all(
        isinstance(name, str) and index.isdigit() for index, name in labels.items()
    ):
        raise ImageRefused(f'{folder / LABELS_FILE}: not labels by class index ({{"0": NAME}})')
    return Preprocessor(processor, {int(index): name for index, name in labels.items()})


@dataclass(frozen=True)
class Classified:
    # Per image, its `top` labels, most likely first, with their probabilities.
    ranked: tuple[tuple[tuple[str, float], ...], ...]
    batch_ms: float


def classify(
    loaded: Loaded, preprocessor: Preprocessor, pixels: torch.Tensor, top: int
) -> Classified:
    """The batch of `pixels` run once; each image's `top` labels."""
    started = time.perf_counter()
    try:
        (logits,) = loaded.run([pixels])
    except Exception as error:
        raise ArtifactFailed(f"the artifact failed on {tuple(pixels.shape)}: {error}") from error
    batch_ms = (time.perf_counter() - started) * 1e3
    probabilities = torch.softmax(logits.double(), dim=-1)
    best = probabilities.topk(min(top, probabilities.shape[-1]), dim=-1)
    ranked = tuple(
        tuple(
            (preprocessor.labels.get(int(index), str(int(index))), float(p))
            for p, index in zip(values, indices, strict=True)
        )
        for values, indices in zip(best.values, best.indices, strict=True)
    )
    return Classified(ranked, batch_ms)
