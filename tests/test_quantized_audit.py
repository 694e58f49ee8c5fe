"""The weights audit on quantized artifacts: a one-layer Llama quantized with torchao and lowered
to ExecuTorch (8da4w, 8da8w) and AOTInductor (int4 weight-only). Untouched, every quantized
weight's values, scales and zero points are checked; a scale, a value or a zero point changed is
named with its weight and group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporter import backends, export, models, quantize
from exporter.artifact import Artifact
from exporter.audit import audit
from tests.conftest import job_in_process
from tests.test_audit import audited, composed, exported_program_beside, rewritten

Weights = dict[str, torch.Tensor]

DOWN_PROJ = "model.model.layers.0.mlp.down_proj.weight"
Q_PROJ = "model.model.layers.0.self_attn.q_proj.weight"
LLAMA = ("model=llama", "model.num_hidden_layers=1", "dynamic.seq.max=16")
# 6 float weights and buffers (3 norms, the embedding, 2 rotary buffers); 8 quantized linear
# weights (7 projections and the head) of 3 parts each.
QUANTIZED, PARTS = 8, 24
# Per group of 32 columns: 64+32+32+64 (attention) + 128+128+64*2 (MLP) + 512*2 (head) groups;
# per channel (8da8w), one per output row.
GROUPS_OF_32, ROWS = 2176, 1024


def lowered(out_dir: Path, *overrides: str) -> tuple[Weights, Artifact]:
    """The quantized model's artifact, and what the job's audit is given: the exported
    program's weights (torchao's quantized tensors among them)."""
    job = composed(*LLAMA, *overrides)
    bundle = quantize.quantized(models.build(job.model, job.dynamic), job.quantize)
    exported = export.run(bundle, job.export, out_dir)
    weights = {**exported.program.state_dict, **exported.program.constants}
    return weights, backends.configured(job).lower(exported, out_dir)


@pytest.fixture(scope="module")
def xnnpack_8da4w(tmp_path_factory: pytest.TempPathFactory) -> tuple[Weights, Artifact]:
    return lowered(tmp_path_factory.mktemp("8da4w"), "backend=executorch", "quantize=8da4w")


@pytest.fixture(scope="module")
def xnnpack_8da8w(tmp_path_factory: pytest.TempPathFactory) -> tuple[Weights, Artifact]:
    return lowered(tmp_path_factory.mktemp("8da8w"), "backend=executorch", "quantize=8da8w")


@pytest.fixture(scope="module")
def aoti_int4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Weights, Artifact]:
    return lowered(tmp_path_factory.mktemp("int4"), "backend=aoti", "quantize=int4_weight")


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def planted(source: Path, target: Path, old: torch.Tensor, new: torch.Tensor) -> Path:
    """A copy of `source` with the bytes of `old`, found once in it, replaced by `new`'s."""
    data = source.read_bytes()
    assert data.count(_bytes(old)) == 1
    target.write_bytes(data.replace(_bytes(old), _bytes(new)))
    return target


def with_one_scale_doubled(weights: Weights, artifact: Artifact, target: Path) -> Path:
    """A copy of an 8da4w .pte with the scale of the down projection's row 5, group 2 doubled.
    XNNPACK stores 4-bit weights' scales in bfloat16: the bytes in the file are those."""
    stored = weights[DOWN_PROJ].scale.to(torch.bfloat16)
    changed = stored.clone()
    changed[5, 2] *= 2
    return planted(artifact.path, target, stored, changed)


@pytest.mark.parametrize(
    ("lowering", "checked", "unseen", "groups", "compared"),
    [
        (
            "xnnpack_8da4w",
            6 + PARTS,
            0,
            GROUPS_OF_32,
            {
                "values": ["int4 packed two per byte, offset by 8"],
                "scales": ["rounded to bfloat16"],
                "zero points": ["0 in every group"],
            },
        ),
        (
            "xnnpack_8da8w",
            6 + PARTS,
            0,
            ROWS,
            {"values": ["exact"], "scales": ["exact"], "zero points": ["0 in every group"]},
        ),
        # Inductor writes the 8-element rotary buffers into its kernels as literals.
        (
            "aoti_int4",
            4 + PARTS,
            2,
            GROUPS_OF_32,
            {"values": ["exact"], "scales": ["exact"], "zero points": ["exact"]},
        ),
    ],
)
def test_an_untouched_quantized_artifact_passes_with_every_quantized_weight_checked(
    request: pytest.FixtureRequest,
    lowering: str,
    checked: int,
    unseen: int,
    groups: int,
    compared: dict[str, list[str]],
) -> None:
    weights, artifact = request.getfixturevalue(lowering)
    assert sum(type(w).__name__ == "IntxUnpackedToInt8Tensor" for w in weights.values()) == 8
    result = audited(weights, artifact)
    assert result.passed, result.lines()
    assert (len(result.checked), len(result.unseen)) == (checked, unseen)
    assert result.quantized == {
        "weights": QUANTIZED,
        "checked": QUANTIZED,
        "groups": groups,
        "compared": compared,
    }
    assert f"{QUANTIZED} of {QUANTIZED} quantized weights checked" in result.lines()[1]
    assert result.to_json()["quantized"]["groups"] == groups


def test_the_quantized_programs_weights_are_checked_by_name(
    xnnpack_8da4w: tuple[Weights, Artifact],
) -> None:
    weights, artifact = xnnpack_8da4w
    result = audit(exported_program_beside(artifact), weights)
    assert result.passed and len(result.checked) == 6 + PARTS
    assert result.quantized is not None and result.quantized["checked"] == QUANTIZED


def test_one_groups_scale_changed_in_the_pte_is_named_by_weight_and_group(
    xnnpack_8da4w: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = xnnpack_8da4w
    stored = weights[DOWN_PROJ].scale.to(torch.bfloat16)
    path = with_one_scale_doubled(weights, artifact, tmp_path / "model.pte")
    result = audited(weights, artifact, path)
    assert not result.passed
    (mismatch,) = result.mismatched
    assert mismatch.parameter == f"{DOWN_PROJ}.scale"
    assert (mismatch.groups, mismatch.differing_groups) == (64 * 4, 1)
    assert mismatch.groups_at == ("row 5 group 2 (columns 64-95)",)
    assert mismatch.paired_by == "key" and mismatch.how == "rounded to bfloat16"
    assert mismatch.max_abs == pytest.approx(float(stored[5, 2]))
    assert result.quantized is not None and result.quantized["checked"] == QUANTIZED - 1
    line = f"mismatch: {DOWN_PROJ}.scale: 1 of 256 groups differ (1 of 256 elements): row 5 group 2"
    assert any(line in shown for shown in result.lines())
    assert result.to_json()["mismatched"][0]["groups_at"] == ["row 5 group 2 (columns 64-95)"]


def test_one_packed_int4_value_changed_in_the_pte_is_named_by_its_group(
    xnnpack_8da4w: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = xnnpack_8da4w
    values = weights[Q_PROJ].qdata
    # As XNNPACK packs them: offset by 8, two per byte, the even column in the low nibble.
    offset = (values.to(torch.int16) + 8).to(torch.uint8)
    packed = offset[:, 1::2] << 4 | offset[:, 0::2]
    changed = packed.clone()
    changed[7, 20] ^= 0x10  # the high nibble: column 41, in the second group of 32
    path = planted(artifact.path, tmp_path / "model.pte", packed, changed)
    (mismatch,) = audited(weights, artifact, path).mismatched
    assert mismatch.parameter == f"{Q_PROJ}.qdata"
    assert (mismatch.differing, mismatch.differing_groups) == (1, 1)
    assert mismatch.groups_at == ("row 7 group 1 (columns 32-63)",)
    assert mismatch.max_abs == 1.0


def test_a_zero_point_xnnpack_cannot_hold_is_named_by_its_group(
    xnnpack_8da4w: tuple[Weights, Artifact],
) -> None:
    weights, artifact = xnnpack_8da4w
    # The model's weight with one group's zero point moved: XNNPACK's kernels take 0.
    weight = weights[Q_PROJ]
    zero_point = weight.zero_point.clone()
    zero_point[3, 1] = 2
    moved = type(weight)(
        weight.qdata,
        weight.scale,
        zero_point,
        weight.target_dtype,
        weight.block_size,
        weight.dtype,
        weight.activation_quantization,
    )
    result = audited({**weights, Q_PROJ: moved}, artifact)
    (mismatch,) = result.mismatched
    assert mismatch.parameter == f"{Q_PROJ}.zero_point"
    assert mismatch.groups_at == ("row 3 group 1 (columns 32-63)",)
    assert mismatch.paired_by == "the delegate's format" and mismatch.max_abs == 2.0
    assert "stores no zero point" in mismatch.where


def test_one_channels_scale_changed_in_an_8da8w_pte_is_named_by_its_row(
    xnnpack_8da8w: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = xnnpack_8da8w
    stored = weights[DOWN_PROJ].scale  # float32, one per output row
    changed = stored.clone()
    changed[9, 0] = -changed[9, 0]
    path = planted(artifact.path, tmp_path / "model.pte", stored, changed)
    (mismatch,) = audited(weights, artifact, path).mismatched
    assert (mismatch.parameter, mismatch.how) == (f"{DOWN_PROJ}.scale", "as is")
    assert (mismatch.groups, mismatch.groups_at) == (64, ("row 9",))


def test_one_groups_scale_changed_in_an_aoti_package_is_named_by_weight_and_group(
    aoti_int4: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = aoti_int4
    scale = weights[DOWN_PROJ].scale
    changed = scale.clone()
    changed[60, 3] += 1.0
    path = rewritten(artifact.path, tmp_path / "model.pt2", scale, changed)
    (mismatch,) = audited(weights, artifact, path).mismatched
    assert (mismatch.parameter, mismatch.paired_by) == (f"{DOWN_PROJ}.scale", "name")
    assert mismatch.groups_at == ("row 60 group 3 (columns 96-127)",)
    assert "parametrizations" not in mismatch.parameter


def test_a_job_given_a_pte_with_one_groups_scale_changed_fails_on_the_audit(
    xnnpack_8da4w: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = xnnpack_8da4w
    path = with_one_scale_doubled(weights, artifact, tmp_path / "planted.pte")
    record, report = job_in_process(
        tmp_path / "run",
        *LLAMA,
        "backend=executorch",
        "quantize=8da4w",
        f"artifact={path}",
        "validate.localize=off",
    )
    assert record.error is not None and record.error.exit_code == 1
    found = report["weights_audit"]
    assert found["passed"] is False
    (mismatch,) = found["mismatched"]
    assert mismatch["parameter"] == f"{DOWN_PROJ}.scale"
    assert mismatch["groups_at"] == ["row 5 group 2 (columns 64-95)"]
    assert f"{DOWN_PROJ}.scale" in str(record.error)
