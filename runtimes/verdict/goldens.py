"""Golden outputs as validation reads them, and their file: the inputs of every planned live
shape, the float64 oracle's outputs for them, and eager PyTorch at the model's own dtype on the
same inputs: the dtype of each of its outputs, which the artifact must match, and its error
against the oracle, which the reference rule scales. The job computes them (exporter/validate/
goldens.py); a bundle carries their file to the target."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runtimes.verdict.stats import EagerError

# torch is imported by the functions that keep, write and read tensors: importing this module
# needs none, for runtimes/formats/bundle.py, whose manifest the exporter's command process reads
# without torch (exporter/tracking/runs.py).
if TYPE_CHECKING:
    import torch

GOLDENS_FILE = "goldens.pt"

Inputs = tuple["torch.Tensor", ...]


@dataclass(frozen=True)
class Goldens:
    # Live shape label -> (inputs as the model sees them, expected outputs as a flat list).
    cases: dict[str, tuple[Inputs, list[torch.Tensor]]]
    # Per output, flat as the cases' outputs: its dtype from the module as built. The float64
    # oracle cannot say it, and a runtime that returns another dtype is wrong however close.
    output_dtypes: tuple[torch.dtype, ...]
    # Live shape label -> per output, eager's error at the model's dtype against the oracle.
    reference: dict[str, list[EagerError]]
    # Where eager ran for `reference`: the device kind of the artifact's target (cpu, cuda).
    reference_device: str
    # Per output, flat as the cases' outputs: whether it holds next-token logits on its last
    # axis, whose predictions validation measures (goldens written before this field: none).
    logits: tuple[bool, ...] = ()
    # A model with a KV cache: its sessions, run in order on one loaded instance, and the greedy
    # generation the artifact is compared on (runtimes/verdict/sessions.py says what they hold).
    # The cases are then the sessions' judged steps, by their labels.
    sessions: tuple[dict, ...] = ()
    greedy: dict | None = None
    # A quantized model: per case, the float model's float64 next-token logits (its first
    # logits output), which the artifact's own are measured against for quality
    # (exporter/quantize/verdict.py); and what the goldens measured of quality as plain data:
    # the quantized model in eager, the perplexity of both on a text, the float model's greedy
    # tokens. Empty for a float model.
    unquantized: dict[str, torch.Tensor] = field(default_factory=dict)
    quality: dict = field(default_factory=dict)
    # A quantized causal LM: the rows of text (or random ids) its quality is measured on, the
    # float model's float64 logits on them, and the quantized model's figures in eager
    # (exporter/validate/text.py). Empty otherwise.
    text: dict = field(default_factory=dict)

    def is_logits(self, index: int) -> bool:
        return bool(self.logits) and self.logits[index]


def stored(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The oracle's output as goldens keep it, for an output whose eager dtype is `dtype`."""
    import torch

    # The dtypes whose own rounding (2^-8 or 2^-11 of a value) is so much larger than float32's
    # (2^-24) that an expected output of theirs is kept in float32: the oracle's value rounded
    # to float32 moves an error by at most 1/65536 (bfloat16) or 1/8192 (float16) of one
    # rounding of the model's dtype, and halves the goldens of a bfloat16 1B Llama (272 MB, not
    # 544 MB). Other outputs keep float64: rounding to float32 would be half a unit of the very
    # precision a float32 artifact is judged at.
    narrowed = (torch.bfloat16, torch.float16)
    return expected.to(torch.float32) if dtype in narrowed else expected


def save(goldens: Goldens, folder: Path) -> Path:
    import torch

    # Plain containers: torch.load(weights_only=True) refuses classes it does not know.
    state = vars(goldens) | {
        "reference": {
            key: [vars(error) for error in errors] for key, errors in goldens.reference.items()
        }
    }
    path = folder / GOLDENS_FILE
    torch.save(state, path)
    return path


def load(folder: Path) -> Goldens:
    """The goldens `save` wrote, their tensors mapped from the file: a 1B Llama's float64
    logits (0.38 GB) take memory only once read, not through the stages that come before."""
    import torch

    state = torch.load(folder / GOLDENS_FILE, weights_only=True, mmap=True)
    state["reference"] = {
        key: [EagerError(**error) for error in errors] for key, errors in state["reference"].items()
    }
    return Goldens(**state)
