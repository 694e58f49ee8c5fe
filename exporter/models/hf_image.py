"""What transformers' image classifiers share (ViT, DeiT, Swin, ConvNeXt, ResNet, ...): pixel
values [batch, channels, height, width], normalized as the checkpoint's image processor leaves
them -> class logits [batch, labels].

A model whose position embeddings were learned for one image size (its forward offers
`interpolate_pos_encoding`: ViT, DeiT, BEiT, Swin) is exported at that size, with `batch` its
one dynamic dim (dynamic=hf_image). A convolutional one, which pools whatever its stages leave,
takes any size in its bounds: `height` and `width` are dynamic too (dynamic=hf_image_size).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import AutoImageProcessor, PreTrainedModel

from exporter.models.bundle import ModelDeclaration
from runtimes.classification import LABELS_FILE, PROCESSOR_FILE


class ClassLogits(torch.nn.Module):
    """Pixel values in, class logits out: the signature export and every runtime see, rather
    than transformers' output object."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def fixed_size(model: PreTrainedModel) -> tuple[int, int] | None:
    """The (height, width) that the model's position embeddings were learned at; None where
    it takes any size."""
    if "interpolate_pos_encoding" not in inspect.signature(type(model).forward).parameters:
        return None
    size = model.config.image_size
    return (size, size) if isinstance(size, int) else (size[0], size[1])


def declare_image_classifier(
    model: PreTrainedModel, checkpoint: Path | None = None
) -> ModelDeclaration:
    """`model` behind ClassLogits, fed pixel values as an image processor leaves them (about
    zero mean and unit variance per channel); with the image processor of `checkpoint` where it
    has one, for a target to classify images with."""
    channels = model.config.num_channels
    size = fixed_size(model)

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        height, width = size or (sizes["height"], sizes["width"])
        shape = (sizes["batch"], channels, height, width)
        return (torch.randn(shape, generator=generator),)

    dim_axes = {"batch": (("pixel_values", 0),)}
    if size is None:
        dim_axes.update(height=(("pixel_values", 2),), width=(("pixel_values", 3),))
    return ModelDeclaration(
        module=ClassLogits(model).eval(),
        input_names=("pixel_values",),
        output_names=("logits",),
        dim_axes=dim_axes,
        dim_limits={},
        make_inputs=make_inputs,
        # A distribution over the labels, whose predictions (top-1 agreement, KL divergence)
        # validation measures too.
        logits_outputs=("logits",),
        preprocessor=_processor_writer(checkpoint, model.config.id2label) if checkpoint else None,
    )


def _processor_writer(checkpoint: Path, labels: Mapping[int, str]) -> Callable[[Path], None] | None:
    """What writes the checkpoint's image processor (its save_pretrained files) and the model's
    labels into a folder; None where the checkpoint was saved without an image processor."""
    if not (checkpoint / PROCESSOR_FILE).is_file():
        return None

    def write(folder: Path) -> None:
        processor = AutoImageProcessor.from_pretrained(
            checkpoint, local_files_only=True, trust_remote_code=False
        )
        processor.save_pretrained(folder)
        names = {str(index): name for index, name in sorted(labels.items())}
        (folder / LABELS_FILE).write_text(json.dumps(names, indent=1))

    return write
