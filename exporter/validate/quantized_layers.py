"""torchao's quantized linear and embedding layers computed in float64, for the oracle.

A quantized layer's weight is an `IntxUnpackedToInt8Tensor`: integer values (qdata), and per
block a scale and a zero point, as stored. Its weight in float64 is (qdata - zero point) * scale
with every factor widened first, so nothing is rounded; eager dequantizes at the model's dtype.
A layer quantized with dynamic activations (8da4w, 8da8w) first rounds its input to int8 per
token (a block of one row of the last dim), asymmetrically, as torchao's
`_apply_int8_act_asym_per_token_quant_dequant` does, here in float64 (the arithmetic:
exporter/quantize/float64_ops.py).

Rounding an activation to int8 is not continuous: where x / scale falls within the model's
arithmetic's precision of a tie (n + 1/2), a correct lowering may round it the other way than
torchao does in float64 (its scale computed in another order, its input off by eager's own
error), moving that token's outputs by a whole step. With `ties_flipped`, every activation
within NEAR_TIE of a tie rounds the other way: the oracle's outputs then show how far such
legitimate flips reach, which the reference rule allows besides eager's error
(exporter/validate/goldens.py). A lowering that rounds otherwise (per tensor, symmetric) moves
every token, far beyond it.

The weight is widened a slice of output rows (or the looked-up rows) at a time, as the float
oracle's linear layers are, so no layer's whole float64 weight is ever held.
"""

from __future__ import annotations

import torch
from torchao.quantization import IntxUnpackedToInt8Tensor
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
    IntxUnpackedToInt8TensorActivationQuantization as ActivationQuantization,
)

from exporter.quantize import float64_ops

# The float64 slice of a weight widened at once: 128 MB.
SLICE_ELEMENTS = 1 << 24

_INT8_MIN, _INT8_MAX = -128, 127

# How near a tie x / scale must be, relative to its magnitude, for a correct lowering to round it
# the other way: 64 float32 epsilons (7.6e-6). A float32 artifact's activations are off from the
# oracle's by about eager's relative error, 1e-7 to 1e-6 in the models tried; the scale itself
# is off by an ulp or two.
NEAR_TIE = 8 * torch.finfo(torch.float32).eps


def is_quantized(weight: torch.Tensor) -> bool:
    return isinstance(weight, IntxUnpackedToInt8Tensor)


def has_dynamic_activations(module: torch.nn.Module) -> bool:
    """Whether any layer of `module` rounds its activations as it runs (8da4w, 8da8w)."""
    return any(
        is_quantized(weight := getattr(layer, "weight", None))
        and weight.activation_quantization is not None
        for layer in module.modules()
    )


def linear(module: torch.nn.Linear, x: torch.Tensor, ties_flipped: bool = False) -> torch.Tensor:
    """`module` (its weight quantized) on `x` in float64; `ties_flipped`: its activations' near
    ties rounded the other way."""
    weight = module.weight
    x = x.to(torch.float64)
    if weight.activation_quantization == ActivationQuantization.INT8_ASYM_PER_TOKEN:
        x = int8_per_token(x, torch.finfo(weight.dtype).smallest_normal, ties_flipped)
    elif weight.activation_quantization is not None:
        raise NotImplementedError(
            f"the float64 oracle knows no activation quantization {weight.activation_quantization}"
        )
    block_rows = weight.block_size[0]
    rows = max(block_rows, SLICE_ELEMENTS // weight.shape[1] // block_rows * block_rows)
    slices = []
    for start in range(0, module.out_features, rows):
        wide = _dequantized(weight, slice(start, start + rows))
        bias = None if module.bias is None else module.bias[start : start + rows].to(torch.float64)
        slices.append(torch.nn.functional.linear(x, wide, bias))
    return torch.cat(slices, dim=-1)


def embedding(
    module: torch.nn.Embedding, indices: torch.Tensor, ties_flipped: bool = False
) -> torch.Tensor:
    """`module` (its weight quantized, a block one row high) looking `indices` up in float64:
    the rows it needs only, widened."""
    weight = module.weight
    assert weight.block_size[0] == 1, f"an embedding quantized in blocks {weight.block_size}"
    rows = _dequantized(weight, indices.reshape(-1))
    return rows.reshape(*indices.shape, weight.shape[-1])


def int8_per_token(x: torch.Tensor, eps: float, ties_flipped: bool = False) -> torch.Tensor:
    """`x` quantized to int8 and back per token (each row of its last dim), asymmetrically:
    torchao's dynamic activation quantization, in float64; `ties_flipped`: each value within
    NEAR_TIE of a tie rounded the other way."""
    block = (*[1] * (x.dim() - 1), x.shape[-1])
    scale, zero = float64_ops.choose_qparams_affine(
        x, "ASYMMETRIC", block, torch.int8, _INT8_MIN, _INT8_MAX, eps, None, torch.int8
    )
    if not ties_flipped:
        q = float64_ops.quantize_affine(x, block, scale, zero, torch.int8, _INT8_MIN, _INT8_MAX)
        return float64_ops.dequantize_affine(q, block, scale, zero, torch.int8)
    # One scale and zero point per token, a last dim of 1: they broadcast against x.
    scaled = x * (1.0 / scale)
    rounded = torch.round(scaled)
    near = (scaled - scaled.floor() - 0.5).abs() < NEAR_TIE * scaled.abs().clamp(min=1)
    # floor + ceil - rounded: the other neighbour of a value between two integers.
    rounded = torch.where(near, scaled.floor() + scaled.ceil() - rounded, rounded)
    zero = zero.to(torch.float64)
    q = torch.clamp(rounded + zero, _INT8_MIN, _INT8_MAX)
    return (q - zero) * scale


def _dequantized(weight: IntxUnpackedToInt8Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """The weight's `rows` (whole blocks of rows) in float64."""
    block_rows = weight.block_size[0]
    if isinstance(rows, slice):
        blocks = slice(rows.start // block_rows, -(-rows.stop // block_rows))
    else:
        blocks = torch.div(rows, block_rows, rounding_mode="floor")
    return float64_ops.dequantize_affine(
        weight.qdata[rows],
        weight.block_size,
        weight.scale[blocks],
        weight.zero_point[blocks],
        torch.int8,
    )
