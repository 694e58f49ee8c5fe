"""backend=webgpu with image classifiers (model=hf): a tiny ViT, ConvNeXt and ResNet, each a job
that passes at every live shape on lavapipe, with what stays on the CPU and why in
partition.json; an op that ExecuTorch's partitioner delegates and the runtime has no kernel for,
kept on the CPU by the lowering with its reason; and a dynamic dim that ExecuTorch's Vulkan
lowering would fix at its example size (ResNet's batch), kept dynamic, or else refused by name.

The kernels these models needed (gelu, layer norm, batch norm, max pooling, means over the
pixels) are tested one at a time in tests/test_webgpu_kernels.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from executorch.backends.vulkan._passes.squeeze_unsqueeze_inputs import SqueezeUnsqueezeInputs

from exporter import export, models
from exporter.backends.webgpu.dynamic_dims import dim_sizes, kept_dynamic
from exporter.errors import LoweringFailed
from tests.conftest import job_in_process
from tests.test_hf_image import ARCHITECTURES, saved_checkpoints
from tests.test_webgpu import composed

RUNTIME_LACKS = "the WebGPU runtime has no kernel for it (runtimes/loaders/webgpu/kernels)"
# ExecuTorch's partitioner takes a convolution of batch 1 only.
CONVOLUTION = f"{RUNTIME_LACKS}; WebGPU partitioner: op args not supported"
# Each classifier of tests/test_hf_image.py (its checkpoint built by that file's fixture): how
# many live shapes validation plans for it, the ops its payloads need new kernels for (node
# counts, all delegated) and what stays on the CPU (node counts).
EXPECTED = {
    "vit": (
        5,
        {"aten.gelu.default": 2, "aten.native_layer_norm.default": 5},
        # The patch embedding; the attention's scaling and "safe softmax", as ExecuTorch
        # decomposes attention of a dynamic batch (xnnpack_rewrites' takes a static one only).
        {
            "aten.convolution.default": 1,
            "aten.any.dim": 2,
            "aten.scalar_tensor.default": 4,
            "aten.mul.Scalar": 4,
        },
    ),
    "convnext": (
        13,
        {"aten.gelu.default": 4, "aten.native_layer_norm.default": 9},
        # The pooling's mean over height and width without keepdim, which ExecuTorch refuses.
        {"aten.convolution.default": 8, "aten.mean.dim": 1},
    ),
    "resnet": (
        13,
        {
            "aten._native_batch_norm_legit_no_training.default": 16,
            "aten.max_pool2d_with_indices.default": 1,
            "aten.mean.dim": 1,
        },
        {"aten.convolution.default": 16},
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return saved_checkpoints(tmp_path_factory.mktemp("images"))


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_classifier_passes_at_every_live_shape_its_convolutions_on_the_cpu(
    name: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    dynamic = ARCHITECTURES[name][2]
    shapes, new_kernels, on_cpu = EXPECTED[name]
    record, report = job_in_process(
        tmp_path,
        "model=hf",
        f"model.checkpoint={checkpoints[name]}",
        f"dynamic={dynamic}",
        "backend=webgpu",
        "backend.device=cpu",
    )
    assert record.exit_code == 0, record.error
    assert report["passed"] and len(report["shapes"]) == shapes
    assert all(shape["passed"] for shape in report["shapes"])
    assert "llvmpipe" in report["target"]["adapter"]
    partition = json.loads((tmp_path / "partition.json").read_text())
    assert partition["ops_outside"] == on_cpu
    delegated = [n["op"] for n in partition["nodes"] if n["placement"] == "VulkanBackend"]
    assert {op: delegated.count(op) for op in new_kernels} == new_kernels
    details = {n["detail"] for n in partition["nodes"] if n["op"] == "aten.convolution.default"}
    assert details == {CONVOLUTION}


def test_an_op_the_runtime_has_no_kernel_for_runs_on_the_cpu_between_delegates(
    tmp_path: Path,
) -> None:
    # ExecuTorch's partitioner takes leaky_relu (its native runtime has a shader for it):
    # delegated, the artifact would fail to load here, naming it.
    record, report = job_in_process(
        tmp_path,
        "model=custom",
        "model.factory=tests.webgpu_models:leaky_relu_mlp",
        "dynamic.batch.max=8",
        "backend=webgpu",
        "backend.device=cpu",
    )
    assert record.exit_code == 0, record.error
    assert report["passed"]
    partition = json.loads((tmp_path / "partition.json").read_text())
    assert partition["delegates"] == 2
    assert partition["ops_outside"] == {"aten.leaky_relu.default": 1}
    (leaky,) = [n for n in partition["nodes"] if n["placement"] == "cpu"]
    assert (leaky["reason"], leaky["detail"]) == ("unsupported by the backend", RUNTIME_LACKS)


def test_a_dynamic_dim_the_lowering_fixes_is_refused_by_name(tmp_path: Path) -> None:
    job = composed("model=rms_norm")
    exported = export.run(models.build(job.model, job.dynamic), job.export, tmp_path)
    (seq,) = dim_sizes(exported).values()
    squeeze = SqueezeUnsqueezeInputs.should_squeeze
    refusal = r"fixed dynamic seq at 128: .* \(dynamic\.seq\.min=128 dynamic\.seq\.max=128\)"
    with pytest.raises(LoweringFailed, match=refusal), kept_dynamic(exported):
        # What ExecuTorch's squeeze pass did to ResNet's batch against its 8 channels: a
        # comparison that torch answers from export's example, the upper bound, and keeps; then
        # the serializer's failure on the size node, now an int.
        if seq == 128:
            raise RuntimeError("Cannot create value for node sym_size with spec of type int")
    assert SqueezeUnsqueezeInputs.should_squeeze is squeeze


def test_the_squeeze_pass_asks_nothing_of_a_symbolic_size_while_lowering(tmp_path: Path) -> None:
    job = composed("model=rms_norm")
    exported = export.run(models.build(job.model, job.dynamic), job.export, tmp_path)
    (seq,) = dim_sizes(exported).values()
    with kept_dynamic(exported):
        squeeze = SqueezeUnsqueezeInputs()
        assert squeeze.should_squeeze(None, [seq, 128, 1, 64]) is False
        # A static shape is judged as ExecuTorch judges it.
        assert squeeze.should_squeeze(None, [8, 1, 4, 4]) is True
    assert not seq.node.expr.is_number
