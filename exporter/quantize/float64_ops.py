"""torchao's quantize ops in float64, with the signatures a quantized model's exported program
calls them with: the float64 oracle's quantized layers (exporter/validate/quantized_layers.py)
and the float64 run of localization's node values (exporter/localize/node_values.py) compute
with these, since torchao's own take the model's floating dtypes only.

The arithmetic is torchao's (choose_qparams_affine, quantize_affine, dequantize_affine in
torchao/quantization/quant_primitives.py), on a tensor cut into blocks of `block_size`, each
block with its scale and zero point, every factor widened to float64 first:
  asymmetric: scale = (max(x, 0) - min(x, 0)) / (qmax - qmin), at least eps;
              zero point = clamp(qmin - round(min(x, 0) / scale), qmin, qmax)
  symmetric:  scale = max(-min(x, 0), max(x, 0)) / ((qmax - qmin) / 2), at least eps;
              zero point = (qmax + qmin + 1) / 2, truncated
  quantize:   q = clamp(round(x * (1 / scale)) + zero point, qmin, qmax), half to even
  dequantize: (q - zero point) * scale
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from exporter.quantize.packed import int4pack_mm_float64


def _blocked(x: torch.Tensor, block_size: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """`x` viewed as (blocks, block) per dim, and the dims that run within a block."""
    shape = [
        part
        for size, block in zip(x.shape, block_size, strict=True)
        for part in (size // block, block)
    ]
    return x.reshape(shape), list(range(1, len(shape), 2))


def _per_block(values: torch.Tensor, x: torch.Tensor, block_size: Sequence[int]) -> torch.Tensor:
    """One value per block of `x`, in float64, shaped to broadcast against `x`'s blocked view."""
    shape = [
        part for size, block in zip(x.shape, block_size, strict=True) for part in (size // block, 1)
    ]
    return values.to(torch.float64).reshape(shape)


def choose_qparams_affine(
    x: torch.Tensor,
    mapping_type: str,
    block_size: Sequence[int],
    target_dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
    eps: float | None = None,
    scale_dtype: torch.dtype | None = None,
    zero_point_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    blocked, within = _blocked(x.to(torch.float64), block_size)
    low = torch.clamp(blocked.amin(dim=within), max=0)
    high = torch.clamp(blocked.amax(dim=within), min=0)
    eps = torch.finfo(torch.float64).smallest_normal if eps is None else eps
    if mapping_type == "ASYMMETRIC":
        scale = torch.clamp((high - low) / float(quant_max - quant_min), min=eps)
        zero = torch.clamp(quant_min - torch.round(low / scale), quant_min, quant_max)
    elif mapping_type == "SYMMETRIC":
        scale = torch.max(-low, high) / (float(quant_max - quant_min) / 2)
        scale = torch.clamp(scale, min=eps)
        zero = torch.full_like(scale, int((quant_max + quant_min + 1) / 2))
    else:
        raise NotImplementedError(f"torchao's choose_qparams_affine with {mapping_type}")
    return scale, zero.to(zero_point_dtype or torch.int32)


def quantize_affine(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    output_dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
) -> torch.Tensor:
    blocked, _ = _blocked(x.to(torch.float64), block_size)
    q = torch.round(blocked * (1.0 / _per_block(scale, x, block_size)))
    if zero_point is not None and zero_point.numel():
        q = q + _per_block(zero_point, x, block_size)
    return torch.clamp(q, quant_min, quant_max).reshape(x.shape).to(output_dtype)


def dequantize_affine(
    q: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    input_dtype: torch.dtype,
    quant_min: int | None = None,
    quant_max: int | None = None,
    output_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    blocked, _ = _blocked(q.to(torch.float64), block_size)
    if zero_point is not None and zero_point.numel():
        blocked = blocked - _per_block(zero_point, q, block_size)
    return (blocked * _per_block(scale, q, block_size)).reshape(q.shape)


def float64_op(target: object) -> Callable | None:
    """The float64 stand-in for `target` where it is one of torchao's quantize ops, or the packed
    int4 matmul of quantize=auto's layers (exporter/quantize/packed.py)."""
    if target is torch.ops.aten._weight_int4pack_mm_for_cpu.default:
        return int4pack_mm_float64
    namespace = getattr(torch.ops, "torchao", None)
    if namespace is None or not hasattr(namespace, "dequantize_affine"):
        return None
    return {
        namespace.choose_qparams_affine.default: choose_qparams_affine,
        namespace.quantize_affine.default: quantize_affine,
        namespace.dequantize_affine.default: dequantize_affine,
    }.get(target)
