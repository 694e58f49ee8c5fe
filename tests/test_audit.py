"""The weights audit on real artifacts the project lowers: untouched ones pass with every
parameter checked, and bytes changed inside the file after lowering are named, with numbers."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
from executorch.exir.backend import utils as backend_utils
from executorch.exir.backend.backend_details import PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from hydra import compose, initialize_config_dir
from torch.export import ExportedProgram

from exporter import backends, config, export, models
from exporter.artifact import Artifact, WeightsReader
from exporter.audit import WeightsAudit, audit, executorch_files, readers
from exporter.audit.matching import Constant, audit_constants, sha256
from exporter.validate import goldens
from exporter.validate.plan import plan
from runtimes.formats.pte_file import read_pte
from tests.conftest import CONF_DIR

Weights = dict[str, torch.Tensor]

DOWN_PROJ = "model.model.layers.0.mlp.down_proj.weight"
EMBED = "model.model.embed_tokens.weight"
# One decoder layer: what the audit pairs is the same per layer, and each lowering costs less.
ONE_LAYER = ("model=llama", "model.num_hidden_layers=1")


@cache
def composed(*overrides: str) -> config.JobConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return config.to_job(compose("config", overrides=list(overrides)))


def lowered(out_dir: Path, *overrides: str) -> tuple[Weights, Artifact]:
    """The artifact, and what the job's audit is given: the exported program's parameters,
    buffers and constants by name."""
    job = composed(*overrides)
    exported = export.run(models.build(job.model, job.dynamic), job.export, out_dir)
    weights = {**exported.program.state_dict, **exported.program.constants}
    return weights, backends.configured(job).lower(exported, out_dir)


def tokens_validation_draws(*overrides: str) -> set[int]:
    """The token ids of every input the job's validation plan runs."""
    job = composed(*overrides)
    bundle = models.build(job.model, job.dynamic)
    seed = job.validate.seed
    shapes = plan(bundle.dims, job.validate.extra_shapes, job.validate.random_shapes, seed)
    cases = goldens.compute(bundle, shapes, seed, "cpu").cases
    return {int(token) for inputs, _outputs in cases.values() for token in inputs[0].flatten()}


def exported_program_beside(artifact: Artifact) -> Artifact:
    """The exported program the artifact was lowered from, as the eager backend's artifact."""
    program = artifact.path.parent / export.PROGRAM_FILE
    return replace(artifact, path=program, runtime="eager", audit=WeightsReader.exported_program)


def audited(weights: Weights, artifact: Artifact, path: Path | None = None) -> WeightsAudit:
    return audit(replace(artifact, path=path) if path else artifact, weights)


def rewritten(source: Path, target: Path, old: torch.Tensor, new: torch.Tensor) -> Path:
    """A copy of `source` at `target` with the bytes of `old`, found once in it, replaced by
    those of `new`."""
    data = source.read_bytes()
    old_bytes, new_bytes = _bytes(old), _bytes(new)
    assert data.count(old_bytes) == 1
    target.write_bytes(data.replace(old_bytes, new_bytes))
    return target


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


Lowering = Callable[..., tuple[Weights, Artifact]]


@pytest.fixture(scope="module")
def lowerings(tmp_path_factory: pytest.TempPathFactory) -> Lowering:
    """`lowered` of the overrides, each made once for this module's tests: a lowering costs
    8 to 20 s, and the tests that change an artifact change a copy of it."""
    made: dict[tuple[str, ...], tuple[Weights, Artifact]] = {}

    def lowering(*overrides: str) -> tuple[Weights, Artifact]:
        if overrides not in made:
            made[overrides] = lowered(tmp_path_factory.mktemp("lowered"), *overrides)
        return made[overrides]

    return lowering


WEBGPU_LLAMA = ("backend=webgpu", *ONE_LAYER)
AOTI_LLAMA = ("backend=aoti", *ONE_LAYER)


@pytest.fixture(scope="module")
def llama(lowerings: Lowering) -> tuple[Weights, Artifact]:
    return lowerings("backend=executorch", *ONE_LAYER)


def test_an_untouched_pte_has_every_llama_weight_checked(
    llama: tuple[Weights, Artifact],
) -> None:
    weights, artifact = llama
    result = audited(weights, artifact)
    assert result.passed
    # 1 layer of 7 projections and 2 norms, the final norm, embedding, head, 2 rotary buffers.
    assert len(weights) == 14
    assert len(result.checked) == 14
    assert (result.mismatched, result.unseen, result.corrupted) == ((), (), ())
    where = {c.parameter: c.where for c in result.checked}
    # XNNPACK took the projections and the head; the embedding stayed a program constant.
    assert "named data" in where[DOWN_PROJ]
    assert "program constant" in where[EMBED]
    assert result.to_json()["checked"] == 14


def test_a_layer_scaled_inside_the_pte_is_named_by_its_xnnpack_key(
    llama: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = llama
    down = weights[DOWN_PROJ]
    path = rewritten(artifact.path, tmp_path / "model.pte", down, down * 2)
    result = audited(weights, artifact, path)
    assert not result.passed
    (mismatch,) = result.mismatched
    assert mismatch.parameter == DOWN_PROJ
    assert mismatch.paired_by == "key"
    assert mismatch.elements == mismatch.differing == 64 * 128
    assert mismatch.rows == mismatch.differing_rows == 64
    assert mismatch.max_abs == pytest.approx(float(down.detach().abs().max()))
    assert len(result.checked) == 13
    assert result.unseen == ()
    assert result.to_json()["mismatched"][0]["parameter"] == DOWN_PROJ
    assert any(DOWN_PROJ in line for line in result.lines())


def test_one_embedding_row_corrupted_in_the_pte_is_named_with_its_row(
    llama: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = llama
    embed = weights[EMBED]
    drawn = tokens_validation_draws("backend=executorch", *ONE_LAYER)
    # A token no input of the validation plan draws: validation cannot see its row.
    untouched = max(set(range(512)) - drawn)
    corrupted = embed.detach().clone()
    corrupted[untouched] += 3.0
    path = rewritten(artifact.path, tmp_path / "model.pte", embed, corrupted)
    result = audited(weights, artifact, path)
    (mismatch,) = result.mismatched
    assert mismatch.parameter == EMBED
    # The embedding is an unnamed program constant: the one left of its shape and dtype.
    assert mismatch.paired_by == "shape"
    assert (mismatch.rows, mismatch.differing_rows) == (512, 1)
    assert mismatch.differing_at == (untouched,)
    assert (mismatch.elements, mismatch.differing) == (512 * 64, 64)
    assert mismatch.max_abs == pytest.approx(3.0)
    assert f"1 of 512 rows differ (64 of 32768 elements): rows {untouched}," in mismatch.describe()
    assert len(result.checked) == 13


def test_a_keyed_constant_that_is_no_parameter_fails_when_its_bytes_change(
    llama: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = llama
    held = {hashlib.sha256(_bytes(w)).hexdigest() for w in weights.values()}
    # XNNPACK's one constant of its own (not a parameter), under the SHA-256 of its bytes.
    ((key, blob),) = [
        (k, b) for k, b in read_pte(artifact.path).named_data.items() if k not in held
    ]
    changed = bytearray(blob)
    changed[0] ^= 0xFF
    data = artifact.path.read_bytes()
    assert data.count(blob) == 1
    path = tmp_path / "model.pte"
    path.write_bytes(data.replace(blob, bytes(changed)))
    result = audited(weights, artifact, path)
    assert not result.passed and result.mismatched == ()
    (corrupted,) = result.corrupted
    assert key[:12] in corrupted.where and corrupted.nbytes == len(blob)
    assert len(result.checked) == 14


def test_a_parameter_the_artifact_does_not_carry_is_unseen_not_mismatched(
    llama: tuple[Weights, Artifact],
) -> None:
    weights, artifact = llama
    extra = {**weights, "model.unused.weight": torch.full((64,), 0.5), "model.handle": object()}
    result = audited(extra, artifact)  # type: ignore[arg-type]
    assert result.passed
    assert [u.parameter for u in result.unseen] == ["model.unused.weight", "model.handle"]
    assert "no constant of the artifact holds it" in result.unseen[0].why
    assert "not a tensor" in result.unseen[1].why
    assert len(result.checked) == 14


@pytest.fixture(scope="module")
def embedding_outside(tmp_path_factory: pytest.TempPathFactory) -> tuple[Weights, Artifact]:
    return lowered(
        tmp_path_factory.mktemp("embedding"),
        "backend=executorch",
        "model=embedding",
        "backend.external_weights=true",
    )


def test_external_weights_are_checked_by_name_in_the_ptd(
    embedding_outside: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = embedding_outside
    (name,) = weights
    result = audited(weights, artifact)
    assert [(c.parameter, c.where, c.how) for c in result.checked] == [
        (name, f"model.ptd {name!r}", "exact")
    ]
    # A row corrupted in the .ptd: named by the name it is stored under.
    table = weights[name]
    corrupted = table.detach().clone()
    corrupted[99, :5] = -corrupted[99, :5]
    shutil.copy(artifact.path, tmp_path / "model.pte")
    rewritten(artifact.data_path, tmp_path / "model.ptd", table, corrupted)
    copy = replace(artifact, path=tmp_path / "model.pte", data_path=tmp_path / "model.ptd")
    result = audit(copy, weights)
    (mismatch,) = result.mismatched
    assert (mismatch.parameter, mismatch.paired_by) == (name, "name")
    assert (mismatch.differing_rows, mismatch.differing) == (1, 5)
    # Without the .ptd, its weights are unseen, and why.
    missing = audit(replace(copy, data_path=tmp_path / "none.ptd"), weights)
    assert missing.passed
    assert [u.parameter for u in missing.unseen] == [name]
    assert "outside model.pte" in missing.unseen[0].why


def test_the_webgpu_payloads_weights_are_checked_and_a_scaled_one_named(
    lowerings: Lowering, tmp_path: Path
) -> None:
    weights, artifact = lowerings(*WEBGPU_LLAMA)
    result = audited(weights, artifact)
    assert len(weights) == len(result.checked) == 14
    assert result.passed and result.unseen == ()
    assert "Vulkan's named data" in result.read
    down = weights[DOWN_PROJ]
    path = rewritten(artifact.path, tmp_path / "scaled.pte", down, down * 2)
    (mismatch,) = audited(weights, artifact, path).mismatched
    assert (mismatch.parameter, mismatch.paired_by) == (DOWN_PROJ, "key")
    assert mismatch.differing == mismatch.elements == 64 * 128


def test_the_aoti_packages_weights_are_checked_by_name_crc_or_not(
    lowerings: Lowering, tmp_path: Path
) -> None:
    weights, artifact = lowerings(*AOTI_LLAMA)
    result = audited(weights, artifact)
    assert result.passed and len(result.checked) == 12
    assert {c.how for c in result.checked} == {"exact"}
    # torch's loader runs a package whose weight changed after packaging (it checks no
    # CRC-32): the audit reads the changed bytes and names the weight.
    down = weights[DOWN_PROJ]
    changed = down.detach().clone()
    changed[3, 5] = 100.0
    path = rewritten(artifact.path, tmp_path / "changed.pt2", down, changed)
    (mismatch,) = audited(weights, artifact, path).mismatched
    assert (mismatch.parameter, mismatch.paired_by, mismatch.differing) == (DOWN_PROJ, "name", 1)


def test_the_eager_programs_weights_are_checked_by_name(
    llama: tuple[Weights, Artifact],
) -> None:
    weights, artifact = llama
    result = audit(exported_program_beside(artifact), weights)
    assert len(result.checked) == 14 and result.passed


def test_tensorrt_leaves_every_parameter_unseen_with_why(
    llama: tuple[Weights, Artifact],
) -> None:
    weights, artifact = llama
    engine = replace(
        artifact,
        path=artifact.path.with_suffix(".ep"),
        runtime="tensorrt",
        audit=WeightsReader.tensorrt_engine,
    )
    tensorrt = audit(engine, weights)
    assert tensorrt.passed and tensorrt.checked == ()
    assert [u.parameter for u in tensorrt.unseen] == list(weights)
    assert {u.why for u in tensorrt.unseen} == {readers.TENSORRT_UNSEEN}
    assert tensorrt.to_json()["unseen"] == list(weights)


def test_every_reader_a_backend_can_declare_is_a_function_of_that_name() -> None:
    assert {reader: read.__name__ for reader, read in readers.READERS.items()} == {
        reader: reader.value for reader in WeightsReader
    }


def test_a_file_that_is_no_program_is_reported_unread(
    llama: tuple[Weights, Artifact], tmp_path: Path
) -> None:
    weights, artifact = llama
    path = tmp_path / "model.pte"
    path.write_bytes(b"not a program at all")
    result = audit(replace(artifact, path=path), weights)
    assert result.checked == () and len(result.unseen) == 14
    assert result.unseen[0].why.startswith("the artifact could not be read")


@pytest.mark.parametrize(
    ("overrides", "checked", "unseen"),
    [
        # 7 projections and 2 norms, the final norm, embedding, head, 2 rotary buffers.
        (("backend=executorch", *ONE_LAYER, "model.dtype=bfloat16"), 14, 0),
        (("backend=executorch", *ONE_LAYER, "backend.external_weights=true"), 14, 0),
        (("backend=executorch", "model=encoder"), 16, 0),
        (("backend=executorch", "model=moe"), 17, 0),
        (WEBGPU_LLAMA, 14, 0),
        # Inductor writes the rotary buffers (8 elements) into its kernels as literals.
        (AOTI_LLAMA, 12, 2),
    ],
)
def test_untouched_artifacts_of_every_backend_pass(
    lowerings: Lowering, overrides: tuple[str, ...], checked: int, unseen: int
) -> None:
    weights, artifact = lowerings(*overrides)
    result = audited(weights, artifact)
    assert result.passed
    assert (len(result.checked), len(result.unseen)) == (checked, unseen)


def preprocessed(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The weights of every program XNNPACK's preprocess is given from now on."""
    seen: list[torch.Tensor] = []
    preprocess = XnnpackBackend.preprocess

    def seeing(program: ExportedProgram, specs: list[CompileSpec]) -> PreprocessResult:
        seen.extend(program.state_dict.values())
        return preprocess(program, specs)

    monkeypatch.setattr(XnnpackBackend, "preprocess", staticmethod(seeing))
    return seen


def storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_xnnpack_serializes_the_programs_own_weights_unchanged_not_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ExecuTorch hands each delegate a copy of its partition's program; lowering has that copy
    # share the weight tensors (a 1B model's would otherwise be held twice at once), which the
    # audit then finds serialized unchanged.
    serialized = preprocessed(monkeypatch)
    weights, artifact = lowered(tmp_path, "backend=executorch", "model=mlp")
    assert len(serialized) == len(weights) == 6
    assert storages(serialized) == storages(weights.values())
    result = audited(weights, artifact)
    assert (len(result.checked), result.mismatched) == (6, ())


def test_a_tied_heads_weight_is_not_copied_for_xnnpack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # XNNPACK takes the head, the CPU the embedding's lookup: ExecuTorch copied their shared
    # weight for the delegate (1.05 GB for a 1B Llama) before lowering untied it.
    copied: list[str] = []
    duplicate = backend_utils.duplicate_constant_node

    def copying(program: ExportedProgram, name: str) -> set[str]:
        copied.append(name)
        return duplicate(program, name)

    monkeypatch.setattr(backend_utils, "duplicate_constant_node", copying)
    tied = ("model.tie_word_embeddings=true", *ONE_LAYER)
    weights, artifact = lowered(tmp_path, "backend=executorch", *tied)
    assert weights[EMBED] is weights["model.lm_head.weight"]
    assert copied == []
    result = audited(weights, artifact)
    assert result.passed and len(result.checked) == len(weights) == 14


def test_the_audit_leaves_none_of_the_mapped_artifact_resident(tmp_path: Path) -> None:
    # The readers map the artifact: a 1B model's 6 GB .pte, read through the mapping, stayed
    # resident beside the model's weights until the audit ended (peak 2.5x the weights).
    payload = torch.randn(16, 1024, 1024)  # 64 MiB
    path = tmp_path / "payload.bin"
    path.write_bytes(payload.numpy().tobytes())
    data = executorch_files.mapped(path)
    before = resident_file_bytes()
    result = audit_constants(
        [Constant("payload.bin", data, key=sha256(payload))], {"w": payload}, lambda *_: ""
    )
    assert [c.parameter for c in result.checked] == ["w"]
    assert resident_file_bytes() - before < 8 * 2**20
    sha256(data)
    assert resident_file_bytes() - before > 48 * 2**20


def resident_file_bytes() -> int:
    """This process's resident pages of mapped files (RssFile)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^RssFile:\s+(\d+) kB$", status, re.MULTILINE).group(1)) * 1024
