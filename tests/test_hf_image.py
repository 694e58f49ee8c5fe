"""model=hf with an image classifier: a tiny ViT (its position embeddings fix the image's size),
ConvNeXt and ResNet (any size in bounds), through the builder and through the whole job on
eager, ExecuTorch and AOTInductor; a planted fault (an artifact that resizes every image to the
size it was tried at) caught at the sizes it breaks; and the dims of another task refused at
compose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import runtimes
from exporter import models
from exporter.config import DimBounds
from exporter.errors import ConfigError
from exporter.export import ExportDiagnosed
from exporter.models import DynamicDim
from exporter.models.hf_image import ClassLogits
from exporter.validate.plan import plan
from tests.conftest import job_in_process
from tests.test_hf_models import hf, refused_before_torch_loads

LABELS = 10
VIT_SIZE = 32
# Each architecture: its config and class, and the dynamic config that bounds its dims.
ARCHITECTURES = {
    "vit": (
        transformers.ViTForImageClassification,
        transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=VIT_SIZE,
            patch_size=8,
            num_labels=LABELS,
        ),
        "hf_image",
    ),
    "convnext": (
        transformers.ConvNextForImageClassification,
        transformers.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]),
        "hf_image_size",
    ),
    "resnet": (
        transformers.ResNetForImageClassification,
        transformers.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]
        ),
        "hf_image_size",
    ),
}
# conf/dynamic/hf_image_size.yaml's bounds.
SIZED = {"batch": DimBounds(1, 8), "height": DimBounds(64, 224), "width": DimBounds(64, 224)}


def saved_checkpoints(root: Path) -> dict[str, Path]:
    """Each tiny classifier, saved in `root` with seeded random weights (safetensors)."""
    for name, (cls, config, _) in ARCHITECTURES.items():
        config.num_labels = LABELS
        torch.manual_seed(0)
        cls(config).save_pretrained(root / name)
    return {name: root / name for name in ARCHITECTURES}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return saved_checkpoints(tmp_path_factory.mktemp("images"))


def job(name: str, checkpoints: dict[str, Path]) -> tuple[str, ...]:
    dynamic = ARCHITECTURES[name][2]
    return ("model=hf", f"dynamic={dynamic}", f"model.checkpoint={checkpoints[name]}")


@pytest.mark.parametrize(
    ("name", "sizes", "dims"),
    [
        ("vit", {"batch": 3}, ["batch"]),
        ("convnext", {"batch": 3, "height": 70, "width": 131}, ["batch", "height", "width"]),
        ("resnet", {"batch": 3, "height": 70, "width": 131}, ["batch", "height", "width"]),
    ],
)
def test_builder_outputs_the_classifiers_logits_at_its_dims(
    name: str, sizes: dict[str, int], dims: list[str], checkpoints: dict[str, Path]
) -> None:
    cls, _, _ = ARCHITECTURES[name]
    bounds = {"batch": DimBounds(1, 8)} if name == "vit" else SIZED
    bundle = models.build(hf(checkpoints[name]), bounds)
    assert type(bundle.module.model) is cls
    assert (bundle.input_names, bundle.output_names) == (("pixel_values",), ("logits",))
    assert bundle.logits_outputs == ("logits",)
    assert [dim.name for dim in bundle.dims] == dims
    (pixels,) = bundle.make_inputs(sizes, 0)
    height, width = (VIT_SIZE, VIT_SIZE) if name == "vit" else (sizes["height"], sizes["width"])
    assert pixels.shape == (3, 3, height, width) and pixels.dtype == torch.float32
    # Pixel values as an image processor leaves them: about zero mean, unit variance.
    assert abs(float(pixels.mean())) < 0.05 and abs(float(pixels.std()) - 1) < 0.05
    at_float64 = cls.from_pretrained(checkpoints[name], dtype=torch.float64)
    with torch.no_grad():
        built = bundle.module.to(torch.float64)(pixels.double())
        assert built.shape == (3, LABELS)
        expected = at_float64(pixel_values=pixels.double()).logits
        torch.testing.assert_close(built, expected, atol=1e-12, rtol=0)


def test_a_fixed_size_classifier_has_no_height_or_width_to_bound(
    checkpoints: dict[str, Path],
) -> None:
    with pytest.raises(ConfigError, match=r"no dynamic dim 'height'; its dims are: batch"):
        models.build(hf(checkpoints["vit"]), SIZED)


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("convnext", "eager"),
        ("convnext", "executorch"),
        ("convnext", "aoti"),
        ("vit", "executorch"),
        ("resnet", "executorch"),
        pytest.param("vit", "aoti", marks=pytest.mark.slow),
        pytest.param("resnet", "aoti", marks=pytest.mark.slow),
    ],
)
def test_job_passes_at_every_batch_and_size_corner(
    name: str, backend: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    record, report = job_in_process(run_dir, *job(name, checkpoints), f"backend={backend}")
    assert record.exit_code == 0, record.error
    assert report["passed"] and all(shape["passed"] for shape in report["shapes"])
    assert report["outputs"] == ["logits"]
    planned = [shape["shape"] for shape in report["shapes"]]
    if name == "vit":
        dims = [DynamicDim("batch", (), 1, 8)]
        assert {s["batch"] for s in planned} >= {1, 8}
    else:
        dims = [DynamicDim(n, (), b.min, b.max) for n, b in SIZED.items()]
        corners = {(s["batch"], s["height"], s["width"]) for s in planned}
        assert corners >= {(1, 64, 64), (8, 224, 224), (1, 64, 224), (1, 224, 64)}
    assert planned == [dict(shape) for shape in plan(dims, [], 2, seed=0)]
    # The artifact itself, on the goldens' largest case: one row of logits per image, and the
    # oracle's class for every image.
    manifest = json.loads((run_dir / "bundle" / "manifest.json").read_text())
    goldens = torch.load(run_dir / "bundle" / "goldens.pt", weights_only=False)
    largest = max(goldens["cases"], key=lambda case: goldens["cases"][case][0][0].numel())
    (pixels,), (expected,) = goldens["cases"][largest]
    (got,) = runtimes.load(run_dir / manifest["artifact"], manifest["runtime"]).run([pixels])
    assert got.shape == (8, LABELS)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=0)


class ResizedTo64(torch.nn.Module):
    """The planted fault: an artifact that resizes every image to the size it was tried at
    (64 x 64) before classifying it, right at that size and wrong at every other."""

    def __init__(self, classifier: ClassLogits) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        resized = torch.nn.functional.interpolate(pixel_values, size=(64, 64), mode="bilinear")
        return self.classifier(resized)


def test_an_artifact_with_a_wrong_resize_fails_at_every_other_size(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    bundle = models.build(hf(checkpoints["convnext"]), SIZED)
    dims = {d.name: torch.export.Dim(d.name, min=d.min, max=d.max) for d in bundle.dims}
    faulty = torch.export.export(
        ResizedTo64(bundle.module),
        bundle.make_inputs({"batch": 2, "height": 64, "width": 64}, 0),
        dynamic_shapes={"pixel_values": {0: dims["batch"], 2: dims["height"], 3: dims["width"]}},
    )
    torch.export.save(faulty, tmp_path / "resized.pt2")
    record, report = job_in_process(
        tmp_path / "run",
        *job("convnext", checkpoints),
        "backend=eager",
        f"artifact={tmp_path / 'resized.pt2'}",
    )
    assert record.exit_code == 1
    verdicts = {(s["shape"]["height"], s["shape"]["width"]): s["passed"] for s in report["shapes"]}
    # Judged at 64 x 64 and at other sizes; right only where resizing changes nothing.
    assert verdicts[(64, 64)] and {v for size, v in verdicts.items() if size != (64, 64)} == {False}


def test_another_tasks_dims_are_refused_for_an_image_classifier(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    output = refused_before_torch_loads(
        tmp_path,
        "model=hf",
        "dynamic=hf_encoder",
        f"model.checkpoint={checkpoints['resnet']}",
        "mlflow=off",
    )
    (line,) = [line for line in output.splitlines() if "dynamic:" in line]
    assert (
        "is an image classifier (model_type 'resnet'), whose dims are batch (dynamic=hf_image) "
        "or batch, height and width (dynamic=hf_image_size), and dynamic bounds batch and seq: "
        "choose dynamic=hf_image or dynamic=hf_image_size." in line
    )


def test_a_causal_lms_setting_is_refused_for_an_image_classifier(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = checkpoints["vit"]
    output = refused_before_torch_loads(
        tmp_path, *job("vit", checkpoints), "mlflow=off", "model.kv_cache=static"
    )
    assert (
        f"model.kv_cache=static: model.checkpoint={checkpoint} is an image classifier "
        "(model_type 'vit', task image_classification); model.kv_cache=static is a causal "
        "LM's alone." in output
    )


def test_convnext_in_bfloat16_exports_with_its_guards_checked_at_run_time(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """torch 2.14 cannot prove the guards that ConvNeXt's layer norm over permuted bfloat16
    features puts on the image's size; the export fails naming export.guards=runtime, with which
    the AOTInductor package passes at every live shape."""
    overrides = (*job("convnext", checkpoints), "backend=aoti", "model.dtype=bfloat16")
    with pytest.raises(ExportDiagnosed) as failed:
        job_in_process(tmp_path / "proved", *overrides)
    assert failed.value.diagnosis.failures
    assert {failure.kind for failure in failed.value.diagnosis.failures} == {"guard added"}
    assert "export.guards=runtime checks it when the program runs" in str(failed.value)
    record, report = job_in_process(tmp_path / "run", *overrides, "export.guards=runtime")
    assert record.exit_code == 0, record.error
    assert len(report["shapes"]) == 13 and all(shape["passed"] for shape in report["shapes"])


def test_guards_checked_at_run_time_are_refused_where_executorch_lowers(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    output = refused_before_torch_loads(
        tmp_path, *job("convnext", checkpoints), "mlflow=off", "export.guards=runtime"
    )
    assert (
        "export.guards=runtime: backend=executorch cannot lower a program whose guards are "
        "checked at run time" in output
    )
