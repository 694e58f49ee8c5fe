"""The goldens stage's work: the inputs of every planned live shape, the float64 oracle's
outputs for them, and eager PyTorch at the model's own dtype on the same inputs
(runtimes/verdict/goldens.py says what they hold and how they are kept)."""

from __future__ import annotations

import copy
import logging
import zlib
from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from exporter.errors import GoldensFailed
from exporter.models import ModelBundle
from exporter.quantize.verdict import Measuring
from exporter.validate.oracle import float64_weights
from runtimes.verdict.compare import EagerError, reference_error
from runtimes.verdict.goldens import Goldens, Inputs, stored
from runtimes.verdict.shapes import LiveShape, label

log = logging.getLogger(__name__)


def compute(
    bundle: ModelBundle, shapes: Sequence[LiveShape], seed: int, reference_device: str
) -> Goldens:
    inputs = {
        # Seeded by the shape itself, so adding a shape to the plan changes no other's inputs.
        label(shape): bundle.make_inputs(shape, zlib.crc32(f"{seed}:{label(shape)}".encode()))
        for shape in shapes
    }
    cases = {key: (case, _oracle(bundle.module, key, case)) for key, case in inputs.items()}
    logits = tuple(name in bundle.logits_outputs for name in bundle.output_names)
    unquantized, measuring = _unquantized(bundle, inputs, logits)
    reference, output_dtypes = _reference(bundle.module, cases, reference_device, logits, measuring)
    kept = {
        key: (case, [stored(e, dtype) for e, dtype in zip(expected, output_dtypes, strict=True)])
        for key, (case, expected) in cases.items()
    }
    quality = {"eager": measuring.to_json()} if measuring else {}
    return Goldens(
        kept,
        output_dtypes,
        reference,
        reference_device,
        logits,
        unquantized=unquantized,
        quality=quality,
    )


def _unquantized(
    bundle: ModelBundle, inputs: dict[str, Inputs], logits: tuple[bool, ...]
) -> tuple[dict[str, torch.Tensor], Measuring | None]:
    """A quantized model with next-token logits: the float model's float64 logits per case (its
    first logits output), and what measures eager's quality against them; else nothing."""
    if bundle.unquantized is None or True not in logits:
        return {}, None
    index = logits.index(True)
    float_module = bundle.unquantized.module
    unquantized = {key: _oracle(float_module, key, case)[index] for key, case in inputs.items()}
    return unquantized, Measuring(unquantized, index)


def _oracle(module: torch.nn.Module, key: str, inputs: Inputs) -> list[torch.Tensor]:
    """The module's outputs in float64, its weights widened one module at a time. A model whose
    code reads another module's weights (not its own) cannot run that way; it gets a float64
    copy of the whole model instead, which costs memory but not correctness."""
    wide = [t.to(torch.float64) if t.is_floating_point() else t for t in inputs]

    def layer_by_layer() -> list[torch.Tensor]:
        with float64_weights(module):
            return _run(module, wide)

    def whole_copy() -> list[torch.Tensor]:
        return _run(copy.deepcopy(module).to(torch.float64), wide)

    try:
        try:
            return layer_by_layer()
        except RuntimeError as error:
            log.info(
                "[goldens] the float64 oracle needs a float64 copy of the whole model at %s "
                "(%s: %s)",
                key,
                type(error).__name__,
                error,
            )
            return whole_copy()
    except Exception as error:
        raise GoldensFailed(
            f"the float64 oracle (the eager model in float64) could not run at {key}: "
            f"{type(error).__name__}: {error}. No artifact was judged; the model must run "
            "in float64 for its outputs to be checked."
        ) from error


def _reference(
    module: torch.nn.Module,
    cases: dict[str, tuple[Inputs, list[torch.Tensor]]],
    device: str,
    logits: tuple[bool, ...],
    measuring: Measuring | None = None,
) -> tuple[dict[str, list[EagerError]], tuple[torch.dtype, ...]]:
    """Eager at the model's dtype on `device`, judged against the oracle, with the predictions
    of the outputs that are `logits` (and their quality, where `measuring`); the module returns
    to the CPU after, where export reads it."""
    # Moved only where it must be: `.to` swaps each parameter, and torchao's quantized weights
    # cannot be swapped while export's references to them live.
    on_device = module if device == "cpu" else module.to(device)
    reference = {}
    output_dtypes: tuple[torch.dtype, ...] = ()
    try:
        for key, (inputs, golden) in cases.items():
            outputs = _run(on_device, [t.to(device) for t in inputs])
            output_dtypes = tuple(output.dtype for output in outputs)
            if measuring is not None:
                measuring.add(key, outputs)
            reference[key] = [
                reference_error(output.cpu(), expected, is_logits)
                for output, expected, is_logits in zip(outputs, golden, logits, strict=True)
            ]
    except Exception as error:
        raise GoldensFailed(
            f"eager PyTorch at the model's dtype could not run on {device}: "
            f"{type(error).__name__}: {error}"
        ) from error
    finally:
        if device != "cpu":
            module.to("cpu")
    return reference, output_dtypes


def _run(module: torch.nn.Module | Callable, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return pytree.tree_leaves(module(*inputs))
