"""Goldens: float64 outputs from the oracle, dtypes from the module as built, kept on disk."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from exporter.models import DynamicDim, ModelBundle
from exporter.validate import goldens
from exporter.validate.plan import plan


def bfloat16_linear() -> ModelBundle:
    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["batch"], 8, generator=generator).to(torch.bfloat16),)

    return ModelBundle(
        name="bf16",
        module=torch.nn.Linear(8, 4).to(torch.bfloat16).eval(),
        input_names=("x",),
        output_names=("y",),
        dims=(DynamicDim("batch", (("x", 0),), 1, 4),),
        make_inputs=make_inputs,
    )


def test_goldens_are_float64_but_record_the_models_own_dtype_across_save_and_load(
    tmp_path: Path,
) -> None:
    bundle = bfloat16_linear()
    shapes = plan(bundle.dims, [], 0, seed=0)
    computed = goldens.compute(bundle, shapes, seed=0, reference_device="cpu")
    assert computed.output_dtypes == (torch.bfloat16,)
    assert list(computed.cases) == ["batch=1", "batch=2", "batch=3", "batch=4"]
    inputs, (output,) = computed.cases["batch=3"]
    assert (inputs[0].dtype, output.dtype, output.shape) == (torch.bfloat16, torch.float64, (3, 4))

    goldens.save(computed, tmp_path)
    loaded = goldens.load(tmp_path)
    assert loaded.output_dtypes == (torch.bfloat16,)
    assert loaded.cases.keys() == computed.cases.keys()
    assert torch.equal(loaded.cases["batch=3"][1][0], output)


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
    assert error.max_abs == (eager - golden).abs().max().item() > 0
    # bfloat16 keeps 8 bits: its error is about 2**-9 of the values, nothing like float32's.
    assert 1e-4 < error.nrmse < 1e-2
