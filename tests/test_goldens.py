"""Goldens: the float64 oracle's outputs (kept in float32 for a 16-bit model's outputs), dtypes
from the module as built, kept on disk."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from exporter.models import DynamicDim, ModelBundle
from exporter.validate import goldens
from exporter.validate.oracle import float64_weights
from exporter.validate.plan import plan
from runtimes.verdict import goldens as stored_goldens


def bfloat16_linear() -> ModelBundle:
    return linear(torch.bfloat16)


def linear(dtype: torch.dtype) -> ModelBundle:
    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["batch"], 8, generator=generator).to(dtype),)

    return ModelBundle(
        name=str(dtype),
        module=torch.nn.Linear(8, 4).to(dtype).eval(),
        input_names=("x",),
        output_names=("y",),
        dims=(DynamicDim("batch", (("x", 0),), 1, 4),),
        make_inputs=make_inputs,
    )


def test_a_16_bit_models_goldens_are_the_oracles_in_float32_and_record_its_dtype(
    tmp_path: Path,
) -> None:
    bundle = bfloat16_linear()
    shapes = plan(bundle.dims, [], 0, seed=0)
    computed = goldens.compute(bundle, shapes, seed=0, reference_device="cpu")
    assert computed.output_dtypes == (torch.bfloat16,)
    assert list(computed.cases) == ["batch=1", "batch=2", "batch=3", "batch=4"]
    inputs, (output,) = computed.cases["batch=3"]
    assert (inputs[0].dtype, output.dtype, output.shape) == (torch.bfloat16, torch.float32, (3, 4))
    with torch.no_grad(), float64_weights(bundle.module):
        oracle = bundle.module(inputs[0].to(torch.float64))
    assert torch.equal(output, oracle.to(torch.float32))

    stored_goldens.save(computed, tmp_path)
    loaded = stored_goldens.load(tmp_path)
    assert loaded.output_dtypes == (torch.bfloat16,)
    assert loaded.cases.keys() == computed.cases.keys()
    assert torch.equal(loaded.cases["batch=3"][1][0], output)
    # Mapped from the file, not read into memory: a 1B Llama's logits are 0.38 GB.
    assert mapped_from(tmp_path / stored_goldens.GOLDENS_FILE, loaded.cases["batch=3"][1][0])


def mapped_from(path: Path, tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s bytes lie in a mapping of `path` (/proc/self/maps)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in span.split("-"))
        if name == str(path) and start <= address < end:
            return True
    return False


def test_a_float32_models_goldens_stay_float64() -> None:
    bundle = linear(torch.float32)
    computed = goldens.compute(bundle, plan(bundle.dims, [], 0, seed=0), 0, "cpu")
    assert computed.output_dtypes == (torch.float32,)
    inputs, (output,) = computed.cases["batch=4"]
    with torch.no_grad(), float64_weights(bundle.module):
        assert torch.equal(output, bundle.module(inputs[0].to(torch.float64)))


def test_goldens_record_eagers_error_at_the_models_dtype_per_shape_and_output() -> None:
    bundle = bfloat16_linear()
    shapes = plan(bundle.dims, [], 0, seed=0)
    computed = goldens.compute(bundle, shapes, seed=0, reference_device="cpu")
    assert computed.reference_device == "cpu"
    assert list(computed.reference) == list(computed.cases)
    inputs, (golden,) = computed.cases["batch=4"]
    (error,) = computed.reference["batch=4"]
    with torch.no_grad():
        eager = bundle.module(*inputs).to(torch.float64)
    # Measured against the float64 oracle, which the float32 golden rounds by 2^-24.
    assert error.max_abs == pytest.approx((eager - golden).abs().max().item(), rel=1e-3)
    assert error.max_abs > 0
    # bfloat16 keeps 8 bits: its error is about 2**-9 of the values, nothing like float32's.
    assert 1e-4 < error.nrmse < 1e-2
