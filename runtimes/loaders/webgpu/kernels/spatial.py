"""Ops of convolutional networks on [..., channels, height, width] tensors: batch norm as
inference runs it (running statistics) and 2-D max pooling. One invocation per output element.

Batch norm's parameter words: 0 the element count, 1 the channels, 2 the elements per channel
and image (height * width), 3 eps (f32).
Max pooling's: 0 the output's element count, 1..2 the input's height and width, 3..4 the
output's, 5..6 the window's size, 7..8 its stride, 9..10 the padding, 11..12 the dilation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from runtimes.loaders.webgpu.kernels.base import (
    PARAMS_WGSL,
    WORKGROUP,
    Dispatch,
    Gpu,
    GpuOp,
    GpuTensor,
    Params,
    Recording,
    UnsupportedOp,
    grid_1d,
    tensor_arg,
)

# The flat index of this invocation's element; past the last element, it returns.
_ELEMENT = f"""
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {{
  let i = gid.x + gid.y * groups.x * {WORKGROUP}u;
  if (i >= u(0u)) {{ return; }}
"""


def _batch_norm_code(weight: bool, bias: bool) -> str:
    bindings = [
        "@group(0) @binding(1) var<storage, read_write> out0: array<f32>;",
        "@group(0) @binding(2) var<storage, read> x: array<f32>;",
        "@group(0) @binding(3) var<storage, read> mean: array<f32>;",
        "@group(0) @binding(4) var<storage, read> variance: array<f32>;",
    ]
    value = "(x[i] - mean[c]) * inverseSqrt(variance[c] + uf(3u))"
    if weight:
        bindings.append(
            f"@group(0) @binding({len(bindings) + 1}) var<storage, read> weight: array<f32>;"
        )
        value = f"{value} * weight[c]"
    if bias:
        bindings.append(
            f"@group(0) @binding({len(bindings) + 1}) var<storage, read> bias: array<f32>;"
        )
        value = f"{value} + bias[c]"
    return f"""{PARAMS_WGSL}
{chr(10).join(bindings)}
{_ELEMENT}
  let c = (i / u(2u)) % u(1u);
  out0[i] = {value};
}}
"""


def _floats(name: str, tensors: Sequence[GpuTensor]) -> None:
    if any(t.wgsl != "f32" for t in tensors):
        raise UnsupportedOp(f"{name} on {[t.host_dtype for t in tensors]} (float32 only)")


class BatchNorm(GpuOp):
    """_native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var,
    momentum, eps) -> (out, save_mean, save_invstd): each channel (dim 1) normalized by its
    running statistics; weight and bias may be None. The saved statistics are empty, as ATen
    leaves them outside training."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.input = tensor_arg(name, args[0], "input")
        weight, bias = (
            None if args[p] is None else tensor_arg(name, args[p], what)
            for p, what in ((1, "weight"), (2, "bias"))
        )
        mean = tensor_arg(name, args[3], "running_mean")
        variance = tensor_arg(name, args[4], "running_var")
        self.eps = float(args[6])
        self.out, *self.saved = (tensor_arg(name, t, f"output {k}") for k, t in enumerate(args[-1]))
        if self.input.rank < 2:
            raise UnsupportedOp(f"{name} on a rank-{self.input.rank} input (channels are dim 1)")
        affine = [t for t in (weight, bias) if t is not None]
        tensors = [self.out, self.input, mean, variance, *affine]
        _floats(name, tensors)
        code = _batch_norm_code(weight is not None, bias is not None)
        self.dispatch = Dispatch(gpu, code, tensors)

    def resize(self) -> None:
        self.out.set_dims(self.input.dims, self.name)
        for saved in self.saved:
            saved.set_dims([0], self.name)

    def encode(self, recording: Recording) -> None:
        dims = self.input.dims
        params = Params()
        params.u32(0, self.out.numel)
        params.u32(1, dims[1])
        params.u32(2, math.prod(dims[2:]))
        params.f32(3, self.eps)
        groups = -(-self.out.numel // WORKGROUP)
        self.dispatch.record(recording, params, (*grid_1d(groups), 1) if groups else (0, 0, 0))


# The window's largest element, the first of equals, and its flat index in its image
# (h * width + w), as ATen's max_pool2d_with_indices gives them; padding is never chosen.
_MAX_POOL = f"""{PARAMS_WGSL}
@group(0) @binding(1) var<storage, read_write> out0: array<f32>;
@group(0) @binding(2) var<storage, read_write> indices: array<i32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
{_ELEMENT}
  let H = u(1u); let W = u(2u); let OH = u(3u); let OW = u(4u);
  let ow = i % OW;
  let oh = (i / OW) % OH;
  let image = i / (OW * OH);
  let h0 = i32(oh * u(7u)) - i32(u(9u));
  let w0 = i32(ow * u(8u)) - i32(u(10u));
  var best = 0.0;
  var at = -1;
  for (var a = 0u; a < u(5u); a = a + 1u) {{
    let h = h0 + i32(a * u(11u));
    if (h < 0 || h >= i32(H)) {{ continue; }}
    for (var b = 0u; b < u(6u); b = b + 1u) {{
      let w = w0 + i32(b * u(12u));
      if (w < 0 || w >= i32(W)) {{ continue; }}
      let v = x[image * H * W + u32(h) * W + u32(w)];
      if (at < 0 || v > best) {{ best = v; at = h * i32(W) + w; }}
    }}
  }}
  out0[i] = best;
  indices[i] = at;
}}
"""


def _pair(values: Sequence[int], default: Sequence[int]) -> tuple[int, int]:
    """A (height, width) argument as ATen reads it: one value for both, or none for the
    default."""
    values = list(values) or list(default)
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def pooled_size(
    size: int, kernel: int, stride: int, padding: int, dilation: int, ceil: bool
) -> int:
    """ATen's output size of pooling along one dim (pooling_output_shape)."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil else 0)) // stride + 1
    # With ceil_mode, the last window must start inside the input or its left padding.
    if ceil and (out - 1) * stride >= size + padding:
        out -= 1
    return out


class MaxPool2d(GpuOp):
    """max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode) ->
    (out, indices), over the last two dims of x."""

    def __init__(self, gpu: Gpu, name: str, args: Sequence[Any]) -> None:
        super().__init__(gpu, name, args)
        self.input = tensor_arg(name, args[0], "input")
        self.kernel = _pair(args[1], ())
        self.stride = _pair(args[2], self.kernel)
        self.padding = _pair(args[3], (0,))
        self.dilation = _pair(args[4], (1,))
        self.ceil = bool(args[5])
        self.out, self.indices = (
            tensor_arg(name, t, f"output {k}") for k, t in enumerate(args[-1])
        )
        _floats(name, [self.out, self.input])
        if self.input.rank < 3:
            raise UnsupportedOp(f"{name} on a rank-{self.input.rank} input (3 or 4 dims)")
        self.dispatch = Dispatch(gpu, _MAX_POOL, [self.out, self.indices, self.input])

    def resize(self) -> None:
        *images, height, width = self.input.dims
        pooled = [
            pooled_size(size, k, s, p, d, self.ceil)
            for size, k, s, p, d in zip(
                (height, width), self.kernel, self.stride, self.padding, self.dilation, strict=True
            )
        ]
        self.out.set_dims([*images, *pooled], self.name)
        self.indices.set_dims([*images, *pooled], self.name)

    def encode(self, recording: Recording) -> None:
        params = Params()
        words = (
            self.out.numel,
            *self.input.dims[-2:],
            *self.out.dims[-2:],
            *self.kernel,
            *self.stride,
            *self.padding,
            *self.dilation,
        )
        for index, value in enumerate(words):
            params.u32(index, value)
        groups = -(-self.out.numel // WORKGROUP)
        self.dispatch.record(recording, params, (*grid_1d(groups), 1) if groups else (0, 0, 0))


OPS: dict[str, type[GpuOp]] = {
    "aten._native_batch_norm_legit_no_training.default": BatchNorm,
    "aten.max_pool2d_with_indices.default": MaxPool2d,
}
