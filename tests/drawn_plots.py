"""What a plot shows, read back rather than its file's size: the figures that
`comparison.write_plots` draws, taken as it saves them (each panel's x label and each line's
points), and the jobs a PNG draws, told by the colour each job's line has (C0, C1, ...: text,
grid and frames are black or grey, whatever fonts the machine has)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from PIL import Image

# The default colour cycle's colours but C7, which is grey: the antialiased edges of black text
# hold every shade of grey.
JOB_COLOURS = [n for n in range(10) if n != 7]
# Pixels of exactly a job's colour that show its line: a marker alone fills some 40 of them at
# 110 dpi, and its entry in the legend as many again.
DRAWN_PIXELS = 20


@dataclass(frozen=True)
class Panel:
    """One panel of a figure: its x label, and each line's label and points (x, y) in order."""

    xlabel: str
    lines: dict[str, list[tuple[float, float]]]


def panels(figure: Figure) -> list[Panel]:
    """Each panel of `figure`, left to right, as `axes.errorbar` drew its lines."""
    return [
        Panel(
            axes.get_xlabel(),
            {
                container.get_label(): [
                    (float(x), float(y))
                    for x, y in zip(*container.lines[0].get_data(), strict=True)
                ]
                for container in axes.containers
            },
        )
        for axes in figure.axes
    ]


def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures saved from now to the test's end, in the order they were saved."""
    figures: list[Figure] = []
    save = Figure.savefig

    def saving(figure: Figure, *args: object, **kwargs: object) -> None:
        figures.append(figure)
        save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", saving)
    return figures


def job_colours(png: Path) -> list[int]:
    """The jobs whose lines the PNG draws, by their number in the plot (colour C0 is the
    first's)."""
    pixels = np.asarray(Image.open(png).convert("RGB"))
    drawn = []
    for number in JOB_COLOURS:
        colour = np.array([round(255 * channel) for channel in to_rgb(f"C{number}")])
        if int((pixels == colour).all(axis=-1).sum()) >= DRAWN_PIXELS:
            drawn.append(number)
    return drawn
