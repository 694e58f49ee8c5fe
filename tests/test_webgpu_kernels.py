"""The WebGPU runtime's kernels for image classifiers, one op at a time on lavapipe against torch:
gelu (exact and tanh), layer norm, batch norm as inference runs it, 2-D max pooling, and
reductions over adjacent dims. Each op is built as a delegate builds it (at its upper-bound
shapes) and run at live shapes below them, as a delegate runs it; its error against float64 is
held to float32 torch's own."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from runtimes.loaders.webgpu import adapter, kernels
from runtimes.loaders.webgpu.kernels.base import Gpu, GpuOp, GpuTensor, Recording, UnsupportedOp

aten = torch.ops.aten


@pytest.fixture(scope="module")
def gpu() -> Gpu:
    return Gpu(adapter.choose("cpu").request_device_sync())


def uploaded(gpu: Gpu, value: torch.Tensor) -> GpuTensor:
    """`value` in a buffer of its own, float32 or int32 as the runtime holds it."""
    floating = value.is_floating_point()
    host = str(value.dtype).removeprefix("torch.")
    tensor = GpuTensor(
        "f32" if floating else "i32", host, tuple(value.shape), gpu.storage(value.numel() * 4)
    )
    array = value.numpy().astype(np.float32 if floating else np.int32)
    if array.size:
        gpu.device.queue.write_buffer(tensor.buffer, 0, np.ascontiguousarray(array))
    return tensor


def write_live(gpu: Gpu, tensor: GpuTensor, value: torch.Tensor) -> None:
    """`value` into `tensor`'s buffer, as a delegate writes a live input: contiguous, at its
    live dims, which may be under the dims the buffer was sized at."""
    tensor.dims = list(value.shape)
    array = value.contiguous().numpy().astype(np.float32 if tensor.wgsl == "f32" else np.int32)
    gpu.device.queue.write_buffer(tensor.buffer, 0, array)


def output(gpu: Gpu, dims: Sequence[int], dtype: str = "float32") -> GpuTensor:
    """An output's tensor, its buffer sized at `dims`, its upper bound."""
    wgsl = "f32" if dtype == "float32" else "i32"
    return GpuTensor(wgsl, dtype, tuple(dims), gpu.storage(math.prod(dims) * 4))


def run(gpu: Gpu, op: GpuOp) -> None:
    """Resizes `op` to its inputs' live dims and runs its dispatches."""
    op.resize()
    recording = Recording()
    op.encode(recording)
    for buffer, offset, data in recording.uploads():
        gpu.device.queue.write_buffer(buffer, offset, data)
    encoder = gpu.device.create_command_encoder()
    compute_pass = encoder.begin_compute_pass()
    recording.encode(compute_pass)
    compute_pass.end()
    gpu.device.queue.submit([encoder.finish()])


def read(gpu: Gpu, tensor: GpuTensor) -> torch.Tensor:
    """`tensor` at its live dims."""
    data = gpu.device.queue.read_buffer(tensor.buffer)
    dtype = np.float32 if tensor.wgsl == "f32" else np.int32
    array = np.frombuffer(data, dtype=dtype, count=tensor.numel)
    return torch.from_numpy(array.reshape(tensor.dims).copy())


def built(gpu: Gpu, name: str, args: Sequence[Any]) -> GpuOp:
    return kernels.build(gpu, name, list(args))


def assert_float32_close(ours: float, torch_float32: float, magnitude: float) -> None:
    """Our error against float64 at most 1.5 times torch's float32 error on this CPU, or two
    float32 ulps of `magnitude` (the values' scale): torch's own error depends on the CPU's
    vector width (a sum of 16 lanes rounds otherwise than one of 8), ours must not hang on it.
    A wrong kernel is off by far more (the other GELU by 4.7e-4)."""
    assert ours <= max(1.5 * torch_float32, 2 * float(np.spacing(np.float32(magnitude))))


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_computes_the_form_its_argument_names_within_float32_torchs_error(
    gpu: Gpu, approximate: str
) -> None:
    x = torch.cat(
        [torch.linspace(-10, 10, 200_001), torch.tensor([-3e38, -1e4, -40.0, 40.0, 1e4, 3e38])]
    )
    out = output(gpu, x.shape)
    run(gpu, built(gpu, "aten.gelu.default", [uploaded(gpu, x), approximate, out]))
    got = read(gpu, out)
    exact = torch.nn.functional.gelu(x.double(), approximate=approximate)
    ours = torch.nn.functional.gelu(x, approximate=approximate)
    inside = x.abs() <= 10
    # Measured on lavapipe over [-10, 10]: exact 4.5e-7 (torch's float32 1.2e-6), tanh 5.9e-7
    # (torch 4.3e-7: WGSL's tanh), a float32 ulp being 9.5e-7 at 10.
    assert_float32_close(
        worst(got[inside], exact[inside]), worst(ours[inside], exact[inside]), 10.0
    )
    # Near zero, relative: exact 2.2e-7 (torch 2.3e-7), tanh 3.9e-7 (torch 2.5e-7), 2 to 3 ulps.
    near_zero = (x.abs() > 1e-3) & (x.abs() < 1)
    relative = (got.double() - exact).abs() / exact.abs()
    assert relative[near_zero].max().item() < 4e-7
    # Beyond, x or 0 exactly, where erf and tanh are +-1 (torch's own exact form overflows
    # to inf at 3e38).
    assert torch.equal(got[~inside], exact[~inside].float())
    # The other form differs by up to 4.7e-4 (tests/test_wrong_kernels.py).
    other = "tanh" if approximate == "none" else "none"
    assert worst(got, torch.nn.functional.gelu(x.double(), approximate=other)) > 1e-4


def test_a_gelu_of_another_approximation_is_refused(gpu: Gpu) -> None:
    x = uploaded(gpu, torch.zeros(4))
    with pytest.raises(UnsupportedOp, match=r"approximate='erf' \(none or tanh\)"):
        built(gpu, "aten.gelu.default", [x, "erf", output(gpu, (4,))])


@pytest.mark.parametrize(
    ("shape", "normalized", "affine"),
    [((6, 37), 1, True), ((3, 4, 100), 2, True), ((5, 64), 1, False)],
    ids=["row-37", "two-dims-400", "no-weight-or-bias"],
)
def test_layer_norm_and_its_statistics_at_a_live_shape_under_its_bound(
    gpu: Gpu, shape: tuple[int, ...], normalized: int, affine: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    # Far from zero mean: a one-pass variance would lose its digits to cancellation.
    x = torch.randn(shape, generator=generator) * 3 + 100
    trailing = list(shape[len(shape) - normalized :])
    weight = torch.randn(trailing, generator=generator) if affine else None
    bias = torch.randn(trailing, generator=generator) if affine else None
    stats = [*shape[: len(shape) - normalized], *[1] * normalized]
    outputs = [output(gpu, shape), output(gpu, stats), output(gpu, stats)]
    x_gpu = uploaded(gpu, x)
    op = built(
        gpu,
        "aten.native_layer_norm.default",
        [
            x_gpu,
            trailing,
            None if weight is None else uploaded(gpu, weight),
            None if bias is None else uploaded(gpu, bias),
            1e-5,
            outputs,
        ],
    )
    # A smaller batch.
    rows = x[: shape[0] - 2]
    write_live(gpu, x_gpu, rows)
    run(gpu, op)
    want = aten.native_layer_norm(
        rows.double(),
        trailing,
        None if weight is None else weight.double(),
        None if bias is None else bias.double(),
        1e-5,
    )
    ours = [read(gpu, t) for t in outputs]
    assert [list(t.shape) for t in ours] == [list(w.shape) for w in want]
    torch_out = torch.nn.functional.layer_norm(rows, trailing, weight, bias, 1e-5)
    # Measured on lavapipe: 1.8e-6 over rows of 37 (torch's float32 7.3e-6), 1.1e-6 over rows of
    # 4 x 100 (torch 8.3e-6), 2.6e-6 without weight or bias (torch 2.1e-6); inputs near 100,
    # where a float32 ulp is 7.6e-6.
    # The inputs' scale: a float32 input near 100 is already off by up to half its ulp.
    assert_float32_close(
        worst(ours[0], want[0]), worst(torch_out, want[0]), rows.abs().max().item()
    )
    # The means within one float32 ulp at 100 (measured: 2.5e-6 to 7.6e-6), 1 / std within
    # 2.5e-8 of about 0.33.
    assert worst(ours[1], want[1]) <= np.spacing(np.float32(100))
    assert worst(ours[2], want[2]) / want[2].abs().max().item() < 2.5e-7


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-weight-or-bias"])
def test_batch_norm_normalizes_each_channel_by_its_running_statistics(
    gpu: Gpu, affine: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 9, 11, generator=generator)
    mean = torch.randn(6, generator=generator)
    variance = torch.rand(6, generator=generator) + 0.1
    weight = torch.randn(6, generator=generator) if affine else None
    bias = torch.randn(6, generator=generator) if affine else None
    outputs = [output(gpu, x.shape), output(gpu, (0,)), output(gpu, (0,))]
    x_gpu = uploaded(gpu, x)
    op = built(
        gpu,
        "aten._native_batch_norm_legit_no_training.default",
        [
            x_gpu,
            None if weight is None else uploaded(gpu, weight),
            None if bias is None else uploaded(gpu, bias),
            uploaded(gpu, mean),
            uploaded(gpu, variance),
            0.1,
            1e-5,
            outputs,
        ],
    )
    live = x[:2, :, :5, :7]
    write_live(gpu, x_gpu, live)
    run(gpu, op)

    def batch_norm(dtype: torch.dtype) -> torch.Tensor:
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dtype)

        return aten._native_batch_norm_legit_no_training(
            live.to(dtype), cast(weight), cast(bias), mean.to(dtype), variance.to(dtype), 0.1, 1e-5
        )[0]

    want = batch_norm(torch.float64)
    got = read(gpu, outputs[0])
    assert got.shape == want.shape
    # Measured on lavapipe: 7.3e-7 with weight and bias (torch's float32 7.3e-7), 6.1e-7
    # without (torch 8.9e-7).
    assert_float32_close(
        worst(got, want), worst(batch_norm(torch.float32), want), want.abs().max().item()
    )
    assert [t.dims for t in outputs[1:]] == [[0], [0]]


# (kernel_size, stride, padding, dilation, ceil_mode), as the payload carries them.
POOLS = {
    "resnet-stem": ([3, 3], [2, 2], [1, 1], [1, 1], False),
    "stride-by-default": ([2, 2], [], [0, 0], [1, 1], False),
    "uneven-dilated": ([3, 2], [2, 1], [1, 0], [2, 1], False),
    "ceil-mode": ([3, 3], [2, 2], [1, 1], [1, 1], True),
    "one-size-for-both": ([3], [2], [1], [1], True),
}


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("shape", [(2, 3, 12, 13), (3, 12, 13)], ids=["4-d", "3-d"])
def test_max_pool_gives_aten_values_and_indices_at_every_live_size(
    gpu: Gpu, pool: str, shape: tuple[int, ...]
) -> None:
    kernel_size, stride, padding, dilation, ceil_mode = POOLS[pool]
    generator = torch.Generator().manual_seed(0)
    # Small integers: windows hold equal values, where the first is the one chosen.
    x = torch.randint(-4, 5, shape, generator=generator).float()
    x_gpu = uploaded(gpu, x)
    bound = aten.max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)[0]
    outputs = [output(gpu, bound.shape), output(gpu, bound.shape, "int64")]
    op = built(
        gpu,
        "aten.max_pool2d_with_indices.default",
        [x_gpu, kernel_size, stride, padding, dilation, ceil_mode, outputs],
    )
    for height, width in [(12, 13), (11, 9), (8, 8), (5, 6)]:
        live = x[..., :height, :width].contiguous()
        write_live(gpu, x_gpu, live)
        run(gpu, op)
        values, indices = aten.max_pool2d_with_indices(
            live, kernel_size, stride, padding, dilation, ceil_mode
        )
        assert torch.equal(read(gpu, outputs[0]), values), (height, width)
        assert torch.equal(read(gpu, outputs[1]), indices.int()), (height, width)


@pytest.mark.parametrize(
    ("name", "dims", "keepdim"),
    [
        ("aten.mean.dim", [-1, -2], True),
        ("aten.sum.dim_IntList", [1, 2], False),
        ("aten.amax.default", [], False),
    ],
    ids=["mean-of-pixels", "sum-of-middle-dims", "amax-of-all"],
)
def test_a_reduction_over_adjacent_dims_reduces_them_as_one(
    gpu: Gpu, name: str, dims: list[int], keepdim: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 9, 11, generator=generator)
    reference = {
        "aten.mean.dim": lambda t: t.mean(dims, keepdim=keepdim),
        "aten.sum.dim_IntList": lambda t: t.sum(dims, keepdim=keepdim),
        "aten.amax.default": lambda t: t.amax(dims, keepdim=keepdim),
    }[name]
    x_gpu = uploaded(gpu, x)
    out = output(gpu, reference(x).shape)
    args = (
        [x_gpu, dims, keepdim, None, out]
        if name != "aten.amax.default"
        else [x_gpu, dims, keepdim, out]
    )
    op = built(gpu, name, args)
    live = x[:2, :, :7].contiguous()
    write_live(gpu, x_gpu, live)
    run(gpu, op)
    want = reference(live.double())
    got = read(gpu, out)
    assert got.shape == want.shape
    # Measured on lavapipe: the means of 77 pixels within 1.7e-8 (torch's float32 2.0e-8), the
    # sums of 45 within 7.8e-7 (torch 1.0e-6), the max exact.
    assert_float32_close(worst(got, want), worst(reference(live), want), want.abs().max().item())


def test_a_reduction_over_dims_apart_is_refused(gpu: Gpu) -> None:
    x = uploaded(gpu, torch.zeros(2, 3, 4))
    with pytest.raises(UnsupportedOp, match=r"over dims \[0, 2\] \(adjacent dims only\)"):
        built(gpu, "aten.mean.dim", [x, [0, 2], True, None, output(gpu, (1, 3, 1))])
