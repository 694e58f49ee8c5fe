"""An image file as a vision-language model's encode method takes it (SmolVLM's one image, at
its vision tower's size): read by Pillow, resized to the processor's longest edge with its aspect
kept and then to the tower's square, rescaled and normalized with the checkpoint's image
processor settings, as SmolVLM's processor makes an image it does not split into tiles. The
settings are read from the processor's preprocessor_config.json, which the bundle carries in
`preprocessor/`, as plain JSON: the target needs Pillow, not transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtimes.classification import PROCESSOR_FILE, ImageRefused, rgb


@dataclass(frozen=True)
class ImageSettings:
    """What the checkpoint's image processor does to an image's values: `resample` is Pillow's
    filter for the resize (transformers stores its number), `rescale` what a byte is multiplied
    by, `mean` and `std` per channel."""

    resample: int
    rescale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # The longest edge the processor first resizes an image to, its aspect kept (None: no
    # such step).
    longest_edge: int | None = None

    def pixel_values(self, path: Path, height: int, width: int) -> torch.Tensor:
        """The image at `path` as [1, channels, height, width], float32."""
        from PIL import Image

        resample = Image.Resampling(self.resample)
        image = rgb(path)
        if self.longest_edge is not None:
            image = image.resize(_aspect_kept(image.size, self.longest_edge), resample=resample)
        image = image.resize((width, height), resample=resample)
        values = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        values = values.view(height, width, 3).permute(2, 0, 1).float() * self.rescale
        mean = torch.tensor(self.mean).view(-1, 1, 1)
        std = torch.tensor(self.std).view(-1, 1, 1)
        return ((values - mean) / std).unsqueeze(0)


def read(folder: Path) -> ImageSettings:
    """The settings of the image processor saved in `folder`; ImageRefused naming the file where
    they cannot be read or make no sense."""
    from PIL import Image

    file = folder / PROCESSOR_FILE
    try:
        config = json.loads(file.read_text())
        normalize = config.get("do_normalize", True)
        rescale = config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else 1
        settings = ImageSettings(
            resample=Image.Resampling(int(config.get("resample", Image.Resampling.LANCZOS))),
            rescale=float(rescale),
            mean=_per_channel(config["image_mean"]) if normalize else (0.0,),
            std=_per_channel(config["image_std"]) if normalize else (1.0,),
            longest_edge=int(config["size"]["longest_edge"]) if config.get("do_resize") else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ImageRefused(
            f"{file}: the image processor's settings cannot be read ({error!r})"
        ) from error
    if not all(value > 0 for value in settings.std):
        raise ImageRefused(f"{file}: image_std {list(settings.std)} must be positive")
    return settings


def _aspect_kept(size: tuple[int, int], longest: int) -> tuple[int, int]:
    """(width, height) with the longer side `longest` and the aspect kept, the shorter side
    rounded down and then up to an even number of pixels, as SmolVLM's processor sizes it."""
    width, height = size
    if width >= height:
        short = int(longest / (width / height))
        return longest, max(short + short % 2, 1)
    short = int(longest * (width / height))
    return max(short + short % 2, 1), longest


def _per_channel(values: Any) -> tuple[float, ...]:
    """One value for every channel, or one for each of three."""
    numbers = tuple(float(value) for value in values)
    if len(numbers) not in (1, 3):
        raise ValueError(f"{len(numbers)} values, not 1 or 3")
    return numbers
