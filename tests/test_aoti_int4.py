"""int4 weights read as 4 bits on aoti: `quantize=int4_weight` computed by PyTorch's int4 kernel
(exporter/quantize/packed.py), and the rewrite of a program for CUDA (runtimes/int4_kernels.py:
each call of the CPU's kernel made one of CUDA's, its weight repacked into CUDA's tiles). The
rewritten graph and the tiles are checked here; that the tiles are CUDA's own packing, and what
CUDA computes, by the tests that need a GPU and by tests/gpu_check.py. The tests named for CUDA
import no conftest, so that `pytest --noconftest -k cuda` runs them on the GPU machine, which
has no MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch.export.pt2_archive._package import load_pt2

from exporter import config, models, quantize
from exporter.audit.matching import Constant, Form, audit_constants, forms
from exporter.errors import ConfigError
from exporter.quantize.packed import PackedEmbedding, PackedLinear, dequantized
from runtimes import int4_kernels

TINY = ("model=llama", "model.num_hidden_layers=1", "dynamic.seq.max=16")
CPU_KERNEL = torch.ops.aten._weight_int4pack_mm_for_cpu.default
CUDA_KERNEL = torch.ops.aten._weight_int4pack_mm.default
PROJECT_ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's int4 packing")


class TiedLM(torch.nn.Module):
    """An embedding tied to a packed output projection (its exact rows read the CPU packing
    too) and one packed layer between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = PackedLinear.from_float(torch.randn(64, 64), 4, 32)
        self.head = PackedLinear.from_float(torch.randn(256, 64), 4, 32, exact_top=4)
        self.embed = PackedEmbedding(self.head, torch.float32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.embed(ids)))


def _lowered_graph() -> tuple[torch.export.ExportedProgram, torch.export.ExportedProgram]:
    """The tied model's program, and what the rewrite for CUDA makes of it (its weights stay on
    the CPU here: the graph and the tiles are what is checked)."""
    program = torch.export.export(TiedLM().eval(), (torch.tensor([[1, 2, 3]]),))
    return program, int4_kernels.program_for_cuda(program)


def test_every_cpu_int4_call_becomes_a_cuda_one_and_a_shared_packing_is_kept_beside_it() -> None:
    program, lowered = _lowered_graph()
    targets = [node.target for node in lowered.graph.nodes]
    assert targets.count(CUDA_KERNEL) == 2 and CPU_KERNEL not in targets
    # The job's own program is left as it was.
    assert [node.target for node in program.graph.nodes].count(CPU_KERNEL) == 2
    state = lowered.state_dict
    # Read by the kernel alone: repacked in place, under its own name.
    cpu_packing = program.state_dict["inner.planes.0.packed"]
    assert torch.equal(state["inner.planes.0.packed"], int4_kernels.for_cuda(cpu_packing))
    # Read by the exact rows and the embedding too (export names the one tensor by its last
    # path, the embedding's): kept, and its tiles a buffer beside it.
    shared = "embed.table.planes.0.packed"
    assert state[shared].shape == (256, 32) and state[shared].dtype == torch.uint8
    beside = [name for name in state if name.endswith(int4_kernels.CUDA_SUFFIX)]
    assert beside == [shared + int4_kernels.CUDA_SUFFIX]
    assert torch.equal(state[beside[0]], int4_kernels.for_cuda(state[shared]))
    buffers = lowered.graph_signature.buffers
    assert len(buffers) == len(program.graph_signature.buffers) + 1 and beside[0] in buffers


def test_the_audit_checks_the_rewritten_programs_weights_against_the_programs_own() -> None:
    program, lowered = _lowered_graph()
    constants = [
        Constant(f"package weight {name}", _bytes(value), value.dtype, tuple(value.shape), name)
        for name, value in lowered.state_dict.items()
    ]
    checked = audit_constants(constants, program.state_dict, lambda *_: "").checked
    how = {found.parameter: found.how for found in checked}
    assert len(how) == len(program.state_dict)
    assert how["inner.planes.0.packed"] == "int4 repacked in CUDA's tiles"
    # The shared packing is checked as it is, and its tiles beside it tie back to it.
    tiles = [c for c in checked if c.parameter == "embed.table.planes.0.packed"]
    assert tiles and tiles[0].how == "exact"
    tampered = dict(lowered.state_dict)
    tiles_name = "embed.table.planes.0.packed" + int4_kernels.CUDA_SUFFIX
    tampered[tiles_name] = tampered[tiles_name].clone()
    tampered[tiles_name].view(-1).view(torch.uint8)[7] ^= 0x10
    constants = [
        Constant(f"package weight {name}", _bytes(value), value.dtype, tuple(value.shape), name)
        for name, value in tampered.items()
    ]
    found = audit_constants(constants, program.state_dict, lambda *_: "")
    assert [m.parameter for m in found.mismatched] == ["embed.table.planes.0.packed"]
    assert found.mismatched[0].differing == 1


def _bytes(value: torch.Tensor) -> memoryview:
    return memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_a_program_without_int4_calls_is_lowered_as_it_is() -> None:
    program = torch.export.export(torch.nn.Linear(4, 4), (torch.ones(1, 4),))
    assert int4_kernels.program_for_cuda(program) is program
    assert int4_kernels.prompts_through_cublas(program) is program


def test_prompts_through_cublas_dequantize_each_weight_and_compute_what_the_kernel_does() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    seq = {1: torch.export.Dim("seq", min=1, max=8)}
    program = torch.export.export(TiedLM().eval(), (ids,), dynamic_shapes=(seq,))
    lowered = int4_kernels.program_for_cuda(program)
    prompts = int4_kernels.prompts_through_cublas(lowered)
    targets = [node.target for node in prompts.graph.nodes]
    assert CUDA_KERNEL not in targets and CPU_KERNEL not in targets
    # The weights are the lowered program's own tensors: the package stores them once for the
    # decode step (which keeps the kernel) and the program.
    assert prompts.state_dict.keys() == lowered.state_dict.keys()
    assert all(prompts.state_dict[n] is lowered.state_dict[n] for n in lowered.state_dict)
    # Runnable on the CPU, unlike CUDA's kernel: the CPU kernel's logits to a bfloat16 rounding.
    expected = program.module()(ids)
    found = prompts.module()(ids)
    assert found.shape == expected.shape == (1, 5, 256)
    assert (found - expected).abs().max() < expected.abs().max() * 2**-6


def test_int4_weight_on_aoti_is_the_int4_kernel_where_it_takes_the_layer() -> None:
    from tests.conftest import composed

    job = config.to_job(composed("backend=aoti", *TINY, "quantize=int4_weight"))
    bundle = models.build(job.model, job.dynamic)
    module = quantize.quantized(bundle, job.quantize, None, job.backend.int4_weight_packed).module
    kinds = {name: type(layer) for name, layer in module.named_modules()}
    packed_layers = sorted(
        name.rsplit(".", 1)[-1] for name, t in kinds.items() if t is PackedLinear
    )
    assert packed_layers == ["down_proj", "gate_proj", "lm_head", "o_proj", "q_proj", "up_proj"]
    # k and v have 32 rows, the kernel's blocks 64: torchao's layers.
    torchao = [n for n, t in kinds.items() if t is torch.nn.Linear]
    assert [n.rsplit(".", 1)[-1] for n in torchao] == ["k_proj", "v_proj"]
    assert all(type(module.get_submodule(n).weight).__name__ != "Parameter" for n in torchao)
    # The output projection ranks its largest logits with the weights' own scales.
    assert module.get_submodule("model.lm_head").exact_top > 0


@pytest.fixture(scope="module")
def int4_aoti_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny Llama's int4_weight job on aoti (CPU): its run dir and report."""
    from tests.conftest import job_in_process

    run_dir = tmp_path_factory.mktemp("int4_aoti")
    record, report = job_in_process(run_dir, "backend=aoti", *TINY, "quantize=int4_weight")
    assert record.error is None, record.error
    return run_dir, report


def test_int4_weight_on_aoti_passes_its_verdict_and_audit(int4_aoti_job: tuple[Path, dict]):
    _, report = int4_aoti_job
    assert report["passed"]
    assert report["quantization"]["linear_layers"] == 8
    assert report["quantization"]["packed_layers"] == 6
    audit = report["weights_audit"]
    assert audit["passed"] and audit["mismatched"] == [], audit


def _checked_on(
    bundle: Path, report: Path, capability: str | None
) -> subprocess.CompletedProcess[str]:
    """`python -m runtimes.check` of `bundle` in a process whose CPU kernels are `capability`'s
    (ATEN_CPU_CAPABILITY; this CPU's own where None)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    command = [sys.executable, "-m", "runtimes.check", str(bundle), "--report", str(report)]
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=PROJECT_ROOT)


def test_a_package_of_the_cpu_kernel_checks_here_and_is_refused_by_a_cpu_that_packs_otherwise(
    int4_aoti_job: tuple[Path, dict], tmp_path: Path
) -> None:
    """The same bundle on this CPU, then in a process whose int4 kernel packs as a CPU without
    vector instructions does (PyTorch's own kernel, told so): there it would compute garbage
    from the weights, so it is refused at load, naming the package and both packings."""
    here = int4_kernels.cpu_packing()
    if (here.block, here.halves) == (32, False):
        pytest.skip("this CPU packs as one without vector instructions: no other packing to run")
    bundle = int4_aoti_job[0] / "bundle"
    package = next(bundle.glob("**/model.pt2"))
    recorded = int4_kernels.PACKING_KEY
    assert f'"{recorded}": "{here.layout()}"' in _metadata_of(package)
    # The export stage's program file, which the eager loader runs, records it too.
    program_file = load_pt2(int4_aoti_job[0] / "program.pt2")
    assert program_file.extra_files == {recorded: here.layout()}

    same = _checked_on(bundle, tmp_path / "here.json", None)
    assert same.returncode == 0, same.stdout + same.stderr

    other = _checked_on(bundle, tmp_path / "other.json", "default")
    assert other.returncode == 5, other.stdout + other.stderr
    assert "Traceback" not in other.stderr
    (line,) = other.stderr.strip().splitlines()
    assert f"packs {here.layout()}; this CPU's (DEFAULT) packs 32-row blocks, pairs" in line
    assert str(package) in line
    assert json.loads((tmp_path / "other.json").read_text())["check"]["exit_code"] == 5


def _metadata_of(package: Path) -> str:
    with zipfile.ZipFile(package) as archive:
        names = [n for n in archive.namelist() if n.endswith("wrapper_metadata.json")]
        return "".join(archive.read(n).decode() for n in names)


def test_a_program_file_of_the_cpu_kernel_records_its_packing_and_another_is_refused(
    tmp_path: Path,
) -> None:
    from runtimes.loaders.eager import ExportedProgramModule

    program = torch.export.export(TiedLM(), (torch.tensor([[1, 2, 3]]),))
    here = int4_kernels.cpu_packing().layout()
    assert int4_kernels.packing_record(program) == {int4_kernels.PACKING_KEY: here}
    plain = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(1, 4),))
    assert int4_kernels.packing_record(plain) == {}

    path = tmp_path / "program.pt2"
    torch.export.save(program, path, extra_files={int4_kernels.PACKING_KEY: "16-row blocks, pairs"})
    with pytest.raises(ValueError) as refused:
        ExportedProgramModule(path)
    assert str(refused.value).startswith(f"{path} holds int4 weights packed for a CPU whose")
    assert "packs 16-row blocks, pairs; this CPU's" in str(refused.value)
    torch.export.save(program, path, extra_files=int4_kernels.packing_record(program))
    ids = torch.tensor([[4, 5, 6]])
    (found,) = ExportedProgramModule(path).run([ids])
    assert torch.equal(found, program.module()(ids))


def test_an_int4_weight_group_the_kernel_does_not_take_is_refused_at_compose() -> None:
    from tests.conftest import composed

    with pytest.raises(ConfigError) as refused:
        config.to_job(composed("backend=aoti", "quantize=int4_weight", "quantize.group_size=16"))
    assert "quantize.group_size=16: backend=aoti computes quantize=int4_weight" in str(
        refused.value
    )


# Rows in the CPU packing's blocks of 64; rows 64 to 256 codes wide: CUDA's tiles of 2, 4 and 8
# k-tiles.
SHAPES = [(64, 96), (128, 64), (192, 256)]


def _cpu_packing(rows: int, cols: int) -> torch.Tensor:
    torch.manual_seed(rows + cols)
    return PackedLinear.from_float(torch.randn(rows, cols), 4, 32).planes[0].packed


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_cuda_tiles_hold_every_code_once_and_unpack_to_the_cpu_packing(rows: int, cols: int):
    cpu_packing = _cpu_packing(rows, cols)
    tiles = int4_kernels.for_cuda(cpu_packing)
    assert tiles.shape == int4_kernels.cuda_shape(rows, cols) and tiles.dtype == torch.int32
    assert torch.equal(int4_kernels.from_cuda(tiles, rows, cols), cpu_packing)
    # A permutation of the codes: one code changed changes one 4-bit value of the tiles.
    codes = int4_kernels.codes_of(cpu_packing).to(torch.int32)
    codes[rows - 1, cols - 1] ^= 0x0F
    changed = int4_kernels.for_cuda(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
    raw, raw_changed = (t.view(torch.uint8).reshape(-1) for t in (tiles, changed))
    assert int((raw != raw_changed).sum()) == 1


def test_the_first_int32_of_cudas_tiles_is_the_kernels_documented_packing() -> None:
    # int4mm.cu packs lane 0's bytes v0..v3 (row 0, bytes 0, 4, 8, 12: codes 0-1, 8-9, 16-17,
    # 24-25, the even column in the high nibble) as v3L v2L v1L v0L v3H v2H v1H v0H, v0H lowest.
    codes = (torch.arange(64 * 256) % 13).view(64, 256).to(torch.int32)
    tiles = int4_kernels.for_cuda(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
    row = codes[0]
    expected = 0
    for place, col in enumerate([0, 8, 16, 24, 1, 9, 17, 25]):
        expected |= int(row[col]) << (4 * place)
    word = tiles.reshape(-1)[0].item() & 0xFFFFFFFF
    assert word == expected


def test_the_audit_ties_cuda_tiles_to_the_cpu_packing_and_unpacks_a_changed_code() -> None:
    cpu_packing = _cpu_packing(128, 256)
    cuda_form = [form for form in forms(cpu_packing) if form.cuda_tiles]
    assert cuda_form == [Form(torch.int32, None, cuda_tiles=True)]
    stored = cuda_form[0].apply(cpu_packing)
    assert torch.equal(stored, int4_kernels.for_cuda(cpu_packing))
    codes = int4_kernels.codes_of(cpu_packing).to(torch.int32)
    codes[70, 5] ^= 0x0F
    changed_packing = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    unstored = cuda_form[0].unstored(int4_kernels.for_cuda(changed_packing), cpu_packing)
    # Back in the CPU packing, where the mismatch is counted and placed: one byte differs.
    assert torch.equal(unstored, changed_packing)
    assert int((unstored != cpu_packing).sum()) == 1


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_cuda_tiles_dequantize_in_plain_ops_to_the_cpu_packings_weight(rows: int, cols: int):
    cpu_packing = _cpu_packing(rows, cols)
    scales_and_zeros = (torch.randn(cols // 32, rows, 2) * 0.01).bfloat16()
    found = int4_kernels.dequantized_from_tiles(
        int4_kernels.for_cuda(cpu_packing), 32, scales_and_zeros
    )
    assert found.dtype == torch.bfloat16 and found.shape == (rows, cols)
    assert torch.equal(found, dequantized(cpu_packing, scales_and_zeros).bfloat16())


@needs_cuda
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_our_placement_of_the_codes_is_cudas_own_packing(rows: int, cols: int) -> None:
    cpu_packing = _cpu_packing(rows, cols)
    on_gpu = int4_kernels.for_cuda(cpu_packing.cuda())
    assert torch.equal(on_gpu.cpu(), int4_kernels.for_cuda(cpu_packing))


@needs_cuda
def test_the_cuda_kernel_computes_what_the_cpu_kernel_does() -> None:
    torch.manual_seed(0)
    plane = PackedLinear.from_float(torch.randn(256, 512), 4, 32).planes[0]
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    on_cpu = plane.matmul(x).float()
    on_cuda = CUDA_KERNEL(
        x.cuda(),
        int4_kernels.for_cuda(plane.packed.cuda()),
        plane.group,
        plane.scales_and_zeros.cuda(),
    )
    exact = x.double() @ plane.dequantized(dtype=torch.float64).T
    # Each is the float64 product to a bfloat16 rounding of the output (2**-8 of its scale).
    scale = exact.abs().max().item()
    assert (on_cuda.cpu().double() - exact).abs().max() < scale * 2**-7
    assert (on_cpu.double() - exact).abs().max() < scale * 2**-7


@needs_cuda
def test_the_cuda_kernels_weight_dequantized_in_plain_ops_computes_what_the_kernel_does() -> None:
    torch.manual_seed(0)
    plane = PackedLinear.from_float(torch.randn(256, 512), 4, 32).planes[0]
    x = torch.randn(130, 512, dtype=torch.bfloat16, device="cuda")
    tiles = int4_kernels.for_cuda(plane.packed.cuda())
    scales_and_zeros = plane.scales_and_zeros.cuda()
    kernel = CUDA_KERNEL(x, tiles, plane.group, scales_and_zeros)
    dequantized_weight = int4_kernels.dequantized_from_tiles(tiles, plane.group, scales_and_zeros)
    found = x @ dequantized_weight.t()
    exact = x.double() @ plane.dequantized(dtype=torch.float64).T.cuda()
    scale = exact.abs().max().item()
    assert (found.double() - exact).abs().max() < scale * 2**-7
    assert (kernel.double() - exact).abs().max() < scale * 2**-7
