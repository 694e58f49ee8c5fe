"""The goldens stage's work: the inputs of every planned live shape, the float64 oracle's
outputs for them, and eager PyTorch at the model's own dtype on the same inputs
(runtimes/verdict/goldens.py says what they hold and how they are kept)."""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import zlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from exporter.errors import GoldensFailed
from exporter.models import ModelBundle
from exporter.quantize.verdict import Measuring
from exporter.validate import quantized_layers, text
from exporter.validate.oracle import float64_weights
from runtimes.verdict.compare import reference_error
from runtimes.verdict.goldens import Goldens, Inputs, stored
from runtimes.verdict.shapes import LiveShape, label
from runtimes.verdict.stats import EagerError

log = logging.getLogger(__name__)


def compute(
    bundle: ModelBundle,
    shapes: Sequence[LiveShape],
    seed: int,
    reference_device: str,
    eval_text: str | None = None,
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
    if quantized_layers.has_dynamic_activations(bundle.module):
        reference = _with_rounding_band(bundle.module, cases, reference, logits)
    kept = {
        key: (case, [stored(e, dtype) for e, dtype in zip(expected, output_dtypes, strict=True)])
        for key, (case, expected) in cases.items()
    }
    quality = {"eager": measuring.to_json()} if measuring else {}
    on_text = text.goldens(bundle, eval_text, seed) if bundle.unquantized else {}
    return Goldens(
        kept,
        output_dtypes,
        reference,
        reference_device,
        logits,
        unquantized=unquantized,
        quality=quality,
        text=on_text,
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


def _oracle(
    module: torch.nn.Module, key: str, inputs: Inputs, ties_flipped: bool = False
) -> list[torch.Tensor]:
    """The module's outputs in float64, its weights widened one module at a time. A model whose
    code reads another module's weights (not its own) cannot run that way; it gets a float64
    copy of the whole model instead, which costs memory but not correctness. `ties_flipped`:
    its quantized activations' near ties rounded the other way."""
    wide = [t.to(torch.float64) if t.is_floating_point() else t for t in inputs]

    def layer_by_layer() -> list[torch.Tensor]:
        with float64_weights(module, ties_flipped):
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


def _with_rounding_band(
    module: torch.nn.Module,
    cases: dict[str, tuple[Inputs, list[torch.Tensor]]],
    reference: dict[str, list[EagerError]],
    logits: tuple[bool, ...],
) -> dict[str, list[EagerError]]:
    """`reference` widened, output by output, to the oracle's own error with its activations'
    near ties rounded the other way (exporter/validate/quantized_layers.py): a lowering that
    rounds a near tie otherwise than torchao in float64 computes the quantized model as
    correctly as eager does."""
    band = {}
    for key, (inputs, expected) in cases.items():
        flipped = _oracle(module, key, inputs, ties_flipped=True)
        band[key] = [
            reference_error(output, golden, is_logits)
            for output, golden, is_logits in zip(flipped, expected, logits, strict=True)
        ]
    log.info(
        "[goldens] activations rounded to int8 as the model runs: near ties rounded the other "
        "way move the oracle's outputs by up to %.3g (max abs), eager's own error is up to "
        "%.3g; the reference rule scales the larger",
        _largest(band),
        _largest(reference),
    )
    return {
        key: [wider(e, b) for e, b in zip(reference[key], band[key], strict=True)]
        for key in reference
    }


def wider(eager: EagerError, band: EagerError) -> EagerError:
    """The larger error of eager's and the rounding band's, measure by measure."""
    return EagerError(
        max(eager.max_abs, band.max_abs),
        max(eager.nrmse, band.nrmse),
        min(eager.top1, band.top1),
        max(eager.kl_mean, band.kl_mean),
        max(eager.kl_max, band.kl_max),
    )


def _largest(errors: dict[str, list[EagerError]]) -> float:
    return max(error.max_abs for outputs in errors.values() for error in outputs)


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
    reference = {}
    output_dtypes: tuple[torch.dtype, ...] = ()
    try:
        with moved_to(module, device) as on_device:
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
    return reference, output_dtypes


@contextlib.contextmanager
def moved_to(module: torch.nn.Module, device: str) -> Iterator[torch.nn.Module]:
    """`module` on `device` for the length of the block, back on the CPU after, where export
    reads it. Moved only where it is elsewhere: a quantized weight that the exported program
    still holds cannot be swapped for a copy, even one on the same device."""
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    if not tensors or tensors[0].device == torch.device(device):
        yield module
        return
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        # torchao's quantized weights move by swapping the tensor object, which fails while the
        # exported program holds a reference to it; a copy's are held by nothing else.
        yield copy.deepcopy(module).to(device)
        return
    try:
        yield module.to(device)
    finally:
        module.to("cpu")


def _run(module: torch.nn.Module | Callable, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return pytree.tree_leaves(module(*inputs))
