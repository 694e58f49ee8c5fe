"""`python -m runtimes.run BUNDLE classify IMAGES`: a tiny ConvNeXt saved with its image processor,
exported through ExecuTorch, labels PNG files on the target as transformers labels them; and what
it cannot take exits 2 in one line."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.conftest import PROJECT_ROOT, job_in_process

LABELS = {0: "cat", 1: "dog", 2: "heron", 3: "kite", 4: "otter", 5: "wren"}
# The processor's images: the shortest edge resized to 96 / crop_pct, then cropped to 96 x 96,
# within dynamic=hf_image_size's 64..224.
SIZE = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("convnext") / "checkpoint"
    config = transformers.ConvNextConfig(
        hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], id2label=LABELS
    )
    torch.manual_seed(0)
    transformers.ConvNextForImageClassification(config).save_pretrained(directory)
    transformers.ConvNextImageProcessor(size={"shortest_edge": SIZE}).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def bundle(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("job") / "run"
    record, _ = job_in_process(
        run_dir,
        "model=hf",
        "dynamic=hf_image_size",
        f"model.checkpoint={checkpoint}",
        "backend=executorch",
        "benchmark=off",
    )
    assert record.exit_code == 0, record.error
    return run_dir / "bundle"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three PNG files of other sizes and contents: noise, a gradient, a block."""
    folder = tmp_path_factory.mktemp("images")
    generator = np.random.default_rng(0)
    gradient = np.linspace(0, 255, 200 * 120 * 3).reshape(120, 200, 3)
    block = np.zeros((150, 150, 3))
    block[40:110, 30:90] = (250, 40, 10)
    pictures = [generator.integers(0, 256, (90, 140, 3)), gradient, block]
    paths = []
    for number, picture in enumerate(pictures):
        paths.append(folder / f"image{number}.png")
        Image.fromarray(picture.astype(np.uint8)).save(paths[-1])
    return paths


def classify(bundle: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "runtimes.run", str(bundle), "classify", *args]
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)


def test_the_bundle_carries_the_processor_and_labels_and_classifies_as_transformers(
    bundle: Path, checkpoint: Path, images: list[Path]
) -> None:
    assert sorted(p.name for p in (bundle / "preprocessor").iterdir()) == [
        "labels.json",
        "preprocessor_config.json",
    ]
    completed = classify(bundle, *map(str, images), "--top", "3")
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].endswith(f"3 images of {SIZE}x{SIZE}, 1 batch")
    assert lines[-1].startswith("[classify] 3 images in 1 call, ")
    # transformers' own preprocessing and model on the same files, in float64.
    processor = transformers.AutoImageProcessor.from_pretrained(checkpoint)
    model = transformers.ConvNextForImageClassification.from_pretrained(
        checkpoint, dtype=torch.float64
    )
    opened = [Image.open(path).convert("RGB") for path in images]
    pixels = processor(opened, return_tensors="pt")["pixel_values"].double()
    with torch.no_grad():
        probabilities = torch.softmax(model(pixel_values=pixels).logits, dim=-1)
    for path, line, expected in zip(images, lines[1:-1], probabilities, strict=True):
        name, _, ranked = line.partition(": ")
        assert name == str(path)
        printed = [entry.rsplit(" ", 1) for entry in ranked.split(", ")]
        best = expected.topk(3)
        assert [label for label, _ in printed] == [LABELS[int(i)] for i in best.indices]
        assert [float(p) for _, p in printed] == pytest.approx(best.values.tolist(), abs=1e-3)


def test_more_images_than_the_largest_batch_run_in_several_calls(
    bundle: Path, images: list[Path]
) -> None:
    completed = classify(bundle, *map(str, images * 3), "--top", "1")
    assert completed.returncode == 0, completed.stderr
    # dynamic=hf_image_size bounds batch at 8: nine images in two calls, each labelled once.
    assert completed.stdout.splitlines()[-1].startswith("[classify] 9 images in 2 calls, ")
    labelled = [line for line in completed.stdout.splitlines() if line.startswith(str(images[0]))]
    assert len(labelled) == 3 and len(set(labelled)) == 1


def test_a_file_that_is_no_image_exits_2_naming_it(
    bundle: Path, images: list[Path], tmp_path: Path
) -> None:
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    completed = classify(bundle, str(images[0]), str(text))
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    (line,) = completed.stderr.strip().splitlines()
    assert line.startswith(f"[classify] {text}: not an image Pillow reads")


def test_a_bundle_without_an_image_processor_exits_2(tmp_path: Path, images: list[Path]) -> None:
    run_dir = tmp_path / "run"
    record, _ = job_in_process(run_dir, "model=mlp", "backend=eager", "benchmark=off")
    assert record.exit_code == 0, record.error
    completed = classify(run_dir / "bundle", str(images[0]))
    assert completed.returncode == 2
    (line,) = completed.stderr.strip().splitlines()
    assert "a bundle of model=mlp without an image processor; classify runs an image" in line


def test_a_processor_beyond_the_artifacts_bounds_exits_2(
    bundle: Path, images: list[Path], tmp_path: Path
) -> None:
    """A bundle whose processor makes 256 x 256 images (its manifest rewritten to match), for an
    artifact exported for 64..224."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    config = copy / "preprocessor" / "preprocessor_config.json"
    config.write_text(
        config.read_text().replace(f'"shortest_edge": {SIZE}', '"shortest_edge": 256')
    )
    manifest = json.loads((copy / "manifest.json").read_text())
    data = config.read_bytes()
    manifest["files"]["preprocessor/preprocessor_config.json"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (copy / "manifest.json").write_text(json.dumps(manifest))
    completed = classify(copy, str(images[0]))
    assert completed.returncode == 2
    (line,) = completed.stderr.strip().splitlines()
    assert "makes images of height 256, and the artifact takes 64..224" in line


def test_an_image_made_to_exhaust_memory_exits_2_naming_it(bundle: Path, tmp_path: Path) -> None:
    """A small PNG file of 200 million pixels, past what Pillow decodes unasked."""
    bomb = tmp_path / "bomb.png"
    Image.new("1", (20_000, 10_000)).save(bomb)
    assert bomb.stat().st_size < 1_000_000
    completed = classify(bundle, str(bomb))
    assert completed.returncode == 2
    (line,) = completed.stderr.strip().splitlines()
    assert line.startswith(f"[classify] {bomb}: refused: Image size (200000000 pixels) exceeds")
