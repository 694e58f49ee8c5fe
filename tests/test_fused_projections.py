"""backend.fused_projections (exporter/backends/common/fused_projections.py): the int4 kernel's
calls that read one input become one call (q/k/v and gate/up of each layer), their codes one
weight and their scales and zeros one table; the program computes what it did; the package
records what each fused weight holds, and the weights audit checks each part as its own
parameter, naming the one whose bytes changed."""

from __future__ import annotations

import collections
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from exporter import backends, config, export, models, quantize
from exporter.artifact import Artifact, fused_weights
from exporter.artifact.fused_weights import Fused
from exporter.audit import audit
from exporter.backends import aoti
from exporter.backends.common.fused_projections import fused_projections
from tests.conftest import composed
from tests.test_audit import rewritten

TWO_LAYERS = ("model=llama", "model.kv_cache=static", "model.num_key_value_heads=4")
INT4 = ("model.dtype=bfloat16", "backend=aoti", "quantize=int4_weight")
KERNEL = "aten._weight_int4pack_mm_for_cpu.default"
LAYER = "model.model.layers.0"


def _program(out_dir: Path, *overrides: str) -> torch.export.ExportedProgram:
    job = config.to_job(composed(*overrides))
    bundle = models.build(job.model, job.dynamic)
    bundle = quantize.quantized(bundle, job.quantize, None, job.backend.int4_weight_packed)
    return export.run(bundle, job.export, out_dir).program


@pytest.fixture(scope="module")
def int4_program(tmp_path_factory: pytest.TempPathFactory) -> torch.export.ExportedProgram:
    return _program(tmp_path_factory.mktemp("int4"), *TWO_LAYERS, *INT4)


def _calls(program: torch.export.ExportedProgram) -> int:
    return collections.Counter(str(node.target) for node in program.graph.nodes)[KERNEL]


def test_each_layers_projections_of_one_input_become_one_call_computing_the_same(
    int4_program: torch.export.ExportedProgram,
) -> None:
    fused, held = fused_projections(int4_program)
    # Per layer, q/k/v three calls to one and gate/up two to one; o, down and the head stay.
    assert _calls(int4_program) == 15 and _calls(fused) == 9
    # Each set's codes and table are one buffer each in place of the layers' own.
    assert len(int4_program.state_dict) - len(fused.state_dict) == 2 * 2 * (5 - 2)
    assert held[f"{LAYER}.self_attn.q_proj.planes.0.packed_fused"] == Fused(
        0, tuple((f"{LAYER}.self_attn.{p}_proj.planes.0.packed", 64) for p in "qkv")
    )
    table = held[f"{LAYER}.mlp.gate_proj.planes.0.scales_and_zeros_fused"]
    assert table.dim == 1 and [size for _, size in table.parts] == [128, 128]
    for name, record in held.items():
        together = torch.cat([int4_program.state_dict[n] for n, _ in record.parts], record.dim)
        assert torch.equal(fused.state_dict[name], together)
    tokens, positions = torch.tensor([[3, 5, 7]]), torch.arange(3)
    got, want = fused.module()(tokens, positions), int4_program.module()(tokens, positions)
    # The kernel computes each output row on its own (equal here); a wrong split would be
    # wrong by the whole output.
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 4 * torch.finfo(want.dtype).eps * scale


def test_a_weight_kept_apart_stays_its_own_call(
    int4_program: torch.export.ExportedProgram,
) -> None:
    kept = f"{LAYER}.self_attn.q_proj.planes.0.packed"
    fused, held = fused_projections(int4_program, keep=(kept,))
    # Layer 0: q alone, k/v one call; layer 1 as before: 3 + 2 calls fewer in all.
    assert _calls(fused) == 15 - 3 - 2 and kept in fused.state_dict
    assert all(kept not in dict(record.parts) for record in held.values())


def test_a_program_without_two_int4_calls_of_one_input_is_left_as_it_is(tmp_path: Path) -> None:
    program = _program(tmp_path, *TWO_LAYERS, "model.dtype=bfloat16", "backend=aoti")
    assert fused_projections(program) == (program, {})


@pytest.mark.parametrize(
    ("overrides", "fuses"),
    [
        ((), False),
        (("backend.device=cuda",), True),
        (("backend.device=cuda", "backend.fused_projections=false"), False),
        (("backend.fused_projections=true",), True),
    ],
)
def test_projections_are_fused_where_it_pays_unless_the_config_says(
    overrides: tuple[str, ...], fuses: bool
) -> None:
    backend = config.to_job(composed("backend=aoti", *overrides)).backend
    assert aoti.fuses_projections(backend) is fuses


@pytest.fixture(scope="module")
def fused_package(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, torch.Tensor], Artifact]:
    """A one-layer int4 Llama's package on the CPU, its projections fused, and what the job's
    audit is given: the exported program's weights."""
    out_dir = tmp_path_factory.mktemp("fused-package")
    job = config.to_job(
        composed(*TWO_LAYERS, *INT4, "model.num_hidden_layers=1", "backend.fused_projections=true")
    )
    bundle = models.build(job.model, job.dynamic)
    bundle = quantize.quantized(bundle, job.quantize, None, job.backend.int4_weight_packed)
    exported = export.run(bundle, job.export, out_dir)
    weights = {**exported.program.state_dict, **exported.program.constants}
    return weights, backends.configured(job).lower(exported, out_dir)


def test_the_audit_checks_each_part_of_a_fused_weight_as_its_own_parameter(
    fused_package: tuple[dict[str, torch.Tensor], Artifact],
) -> None:
    weights, artifact = fused_package
    found = audit(artifact, weights)
    assert found.passed and found.mismatched == () and found.corrupted == ()
    # The rotary frequencies alone: Inductor writes them into its kernels.
    assert all("rotary_emb" in unseen.parameter for unseen in found.unseen)
    parts = [c for c in found.checked if "part of" in c.where]
    # q, k, v and gate, up: codes and table of each.
    assert len(parts) == 2 * 5
    assert {c.parameter for c in parts} >= {f"{LAYER}.mlp.up_proj.planes.0.packed"}


def test_a_changed_code_in_a_fused_weight_is_named_by_its_own_parameter(
    fused_package: tuple[dict[str, torch.Tensor], Artifact], tmp_path: Path
) -> None:
    weights, artifact = fused_package
    name = f"{LAYER}.self_attn.k_proj.planes.0.packed"
    codes = weights[name]
    changed = codes.clone()
    changed[5, 7] ^= 0x10
    path = rewritten(artifact.path, tmp_path / "model.pt2", codes, changed)
    (mismatch,) = audit(replace(artifact, path=path), weights).mismatched
    assert (mismatch.parameter, mismatch.paired_by) == (name, "name")
    assert f"part of {LAYER}.self_attn.q_proj.planes.0.packed_fused" in mismatch.where


@pytest.mark.parametrize(
    "record",
    ['{"w": {"dim": 0}}', '{"w": {"dim": 0, "parts": [["a", "x"]]}}', "[1]", "{"],
)
def test_a_record_that_is_not_one_of_fused_weights_is_a_value_error(record: str) -> None:
    with pytest.raises(ValueError, match="fused_weights"):
        fused_weights.from_json(record)


def test_parts_that_do_not_fill_the_stored_dim_are_a_value_error() -> None:
    record = Fused(0, (("a", 64), ("b", 64)))
    assert record.split_sizes(16) == [8, 8]
    for length in (15, 0):
        with pytest.raises(ValueError, match="do not fill"):
            record.split_sizes(length)
    with pytest.raises(ValueError, match="do not fill"):
        Fused(0, (("a", 0),)).split_sizes(8)
