"""torchao's quantized linear and embedding layers computed in float64, for the oracle.

A quantized layer's weight is an `IntxUnpackedToInt8Tensor`: integer values (qdata), and per
block a scale and a zero point, as stored. Its weight in float64 is (qdata - zero point) * scale
with every factor widened first, so nothing is rounded; eager dequantizes at the model's dtype.
A layer quantized with dynamic activations (8da4w, 8da8w) first rounds its input to int8 per
token, asymmetrically, as torchao's `_apply_int8_act_asym_per_token_quant_dequant` does
(choose_qparams_affine, quantize_affine, dequantize_affine in torchao/quantization/
quant_primitives.py): scale = (max(x, 0) - min(x, 0)) / 255, at least the model dtype's smallest
normal; zero point = clamp(-128 - round(min(x, 0) / scale), -128, 127); q = clamp(round(x * (1 /
scale)) + zero point, -128, 127); rounding half to even. Here that arithmetic runs in float64.

The weight is widened a slice of output rows (or looked-up rows) at a time, as the float
oracle does, so no layer's whole float64 weight is ever held.
"""

from __future__ import annotations

import torch
from torchao.quantization import IntxUnpackedToInt8Tensor
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
    IntxUnpackedToInt8TensorActivationQuantization as ActivationQuantization,
)

# The float64 slice of a weight widened at once: 128 MB.
SLICE_ELEMENTS = 1 << 24

_INT8_MIN, _INT8_MAX = -128, 127


def is_quantized(weight: torch.Tensor) -> bool:
    return isinstance(weight, IntxUnpackedToInt8Tensor)


def linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module` (its weight quantized) on `x` in float64."""
    weight = module.weight
    x = x.to(torch.float64)
    if weight.activation_quantization == ActivationQuantization.INT8_ASYM_PER_TOKEN:
        x = int8_per_token(x, torch.finfo(weight.dtype).smallest_normal)
    elif weight.activation_quantization is not None:
        raise NotImplementedError(
            f"the float64 oracle knows no activation quantization {weight.activation_quantization}"
        )
    rows = _rows_per_slice(weight)
    slices = []
    for start in range(0, module.out_features, rows):
        wide = float64_rows(weight, start, start + rows)
        bias = None if module.bias is None else module.bias[start : start + rows].to(torch.float64)
        slices.append(torch.nn.functional.linear(x, wide, bias))
    return torch.cat(slices, dim=-1)


def embedding(module: torch.nn.Embedding, indices: torch.Tensor) -> torch.Tensor:
    """`module` (its weight quantized) looking `indices` up in float64: the rows it needs only,
    widened."""
    weight = module.weight
    (block_rows, block_columns) = weight.block_size
    flat = indices.reshape(-1)
    blocks = torch.div(flat, block_rows, rounding_mode="floor")
    values = weight.qdata[flat].to(torch.float64)
    scale = weight.scale[blocks].to(torch.float64).repeat_interleave(block_columns, dim=-1)
    zero = weight.zero_point[blocks].to(torch.float64).repeat_interleave(block_columns, dim=-1)
    return ((values - zero) * scale).reshape(*indices.shape, weight.shape[-1])


def float64_rows(weight: IntxUnpackedToInt8Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of the dequantized weight in float64 (`start` a multiple of the block's
    rows)."""
    block_rows, block_columns = weight.block_size
    values = weight.qdata[start:stop].to(torch.float64)
    first, last = start // block_rows, -(-min(stop, weight.shape[0]) // block_rows)

    def widened(per_block: torch.Tensor) -> torch.Tensor:
        wide = per_block[first:last].to(torch.float64)
        wide = wide.repeat_interleave(block_rows, dim=0)[: values.shape[0]]
        return wide.repeat_interleave(block_columns, dim=1)

    return (values - widened(weight.zero_point)) * widened(weight.scale)


def int8_per_token(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x` quantized to int8 and back, per token (each row of the last dim), asymmetrically:
    torchao's dynamic activation quantization, in x's dtype."""
    low = torch.clamp(x.amin(dim=-1, keepdim=True), max=0)
    high = torch.clamp(x.amax(dim=-1, keepdim=True), min=0)
    scale = torch.clamp((high - low) / float(_INT8_MAX - _INT8_MIN), min=eps)
    zero = torch.clamp(_INT8_MIN - torch.round(low / scale), _INT8_MIN, _INT8_MAX)
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zero, _INT8_MIN, _INT8_MAX)
    return (q - zero) * scale


def _rows_per_slice(weight: IntxUnpackedToInt8Tensor) -> int:
    block_rows = weight.block_size[0]
    rows = max(1, SLICE_ELEMENTS // weight.shape[1])
    return max(block_rows, rows - rows % block_rows)
