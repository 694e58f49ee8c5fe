"""backend=webgpu: ExecuTorch's WebGPU lowering, run by runtimes/webgpu on a real wgpu device
(Mesa's lavapipe here: apt-get install mesa-vulkan-drivers).

The fast tests lower toy models in-process and run one Llama job through the CLI, as a user
would; the slow ones run every toy, mlp and llama that way and check each passed at every
planned live shape."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from exporter import backends, config, export, models, validate
from exporter.artifact import Artifact
from exporter.config import ToyKind
from exporter.errors import ConfigError
from exporter.models import ModelBundle
from exporter.validate import goldens
from exporter.validate.plan import plan
from runtimes.loaders.webgpu import adapter, memory_plan
from runtimes.loaders.webgpu.kernels.base import Gpu, GpuTensor, UnsupportedOp
from runtimes.loaders.webgpu.kernels.reduction import Reduction
from runtimes.loaders.webgpu.program import InputOutOfBounds, WebgpuProgram
from tests.conftest import CONF_DIR, CliResult, SweepResult, run_exporter, run_sweep

# The Llama of the fast tests' job: one layer has the default's mask and attention.
ONE_LAYER_LLAMA = ("model=llama", "model.num_hidden_layers=1")


@cache
def composed(*overrides: str) -> config.JobConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return config.to_job(compose("config", overrides=["backend=webgpu", *overrides]))


def lowered(out_dir: Path, *overrides: str) -> tuple[ModelBundle, Artifact]:
    job = composed(*overrides)
    bundle = models.build(job.model, job.dynamic)
    exported = export.run(bundle, job.export, out_dir)
    return bundle, backends.configured(job).lower(exported, out_dir)


@pytest.fixture(scope="module")
def rms_norm(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelBundle, Artifact]:
    return lowered(tmp_path_factory.mktemp("rms_norm"), "model=rms_norm")


def eager(bundle: ModelBundle, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        return bundle.module(*inputs)


def test_one_loaded_program_follows_shrinking_and_growing_shapes(
    rms_norm: tuple[ModelBundle, Artifact],
) -> None:
    bundle, artifact = rms_norm
    program = WebgpuProgram(artifact.path, "cpu")
    assert program.target["adapter_type"] == "CPU"
    for seq in (128, 1, 77, 2, 128, 33):
        inputs = bundle.make_inputs({"seq": seq}, seq)
        (got,) = program.run(inputs)
        want = eager(bundle, inputs)
        assert got.shape == want.shape == (1, seq, 64)
        assert (got - want).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def attention(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelBundle, Artifact]:
    return lowered(tmp_path_factory.mktemp("attention"), "model=gqa_attention")


def test_each_set_of_live_shapes_is_recorded_once_and_replayed_with_its_own_parameters(
    attention: tuple[ModelBundle, Artifact],
) -> None:
    bundle, artifact = attention
    program = WebgpuProgram(artifact.path, "cpu")
    first: dict[int, torch.Tensor] = {}
    for seq in (128, 1, 77, 1, 128, 77):
        inputs = bundle.make_inputs({"seq": seq}, seq)
        (got,) = program.run(inputs)
        # The softmax spans the live keys: another shape's parameters would give other rows.
        assert (got - eager(bundle, inputs)).abs().max().item() < 1e-5
        assert torch.equal(got, first.setdefault(seq, got))
    # Three delegates around the CPU's ops, each recorded at the three sequence lengths.
    assert [len(delegate.recordings) for delegate in program.delegates] == [3, 3, 3]


def test_run_is_download_of_execute_of_upload_timed_by_the_host(
    rms_norm: tuple[ModelBundle, Artifact],
) -> None:
    bundle, artifact = rms_norm
    program = WebgpuProgram(artifact.path, "cpu")
    assert program.clock == "cpu"
    inputs = bundle.make_inputs({"seq": 33}, 3)
    (stepped,) = program.download(program.execute(program.upload(inputs)))
    (ran,) = program.run(inputs)
    assert torch.equal(stepped, ran)
    assert (stepped - eager(bundle, inputs)).abs().max().item() < 1e-5
    with pytest.raises(InputOutOfBounds, match=r"dim 1 is 129"):
        program.upload(bundle.make_inputs({"seq": 129}, 0))


def test_a_view_shares_its_inputs_buffer_which_no_tensor_takes_while_the_view_lives() -> None:
    gpu = Gpu(adapter.choose("cpu").request_device_sync())

    def tensor(dims: tuple[int, ...], dtype: str = "float32") -> GpuTensor:
        return GpuTensor("f32" if dtype == "float32" else "i32", dtype, dims, None)

    a, x, c, e, d = (tensor((4,)) for _ in range(5))
    b = tensor((2, 2))
    mask = tensor((4,), "bool")
    calls = [
        ("aten.view_copy.default", [a, [2, 2], b]),
        # Memory planning could give c the view's input slot: a is not read after the view.
        ("aten.neg.default", [x, c]),
        ("aten.add.Tensor", [b, c, None, e]),
        ("aten.neg.default", [e, d]),
        # A bool of floats is a conversion, so it gets a buffer of its own.
        ("aten._to_copy.default", [d, mask]),
    ]
    aliased = memory_plan.plan(gpu, calls, [a, x, b, c, e, d, mask], [d, mask])
    assert aliased == {0}
    assert b.buffer is a.buffer
    assert c.buffer not in (a.buffer, x.buffer)
    # Buffers come back once every tensor in them was read for the last time.
    assert e.buffer is x.buffer
    assert d.buffer in (a.buffer, c.buffer)
    assert mask.buffer not in (d.buffer, e.buffer)


def test_with_one_resize_rule_disabled_validation_fails_below_the_bound_only(
    rms_norm: tuple[ModelBundle, Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle, artifact = rms_norm

    def keep_upper_bound(op: Reduction) -> None:
        op.out.set_dims(op.out.max_dims, op.name)

    monkeypatch.setattr(Reduction, "resize", keep_upper_bound)
    shapes = plan(bundle.dims, [], 2, 0)
    report = validate.run(
        bundle.output_names,
        lambda: WebgpuProgram(artifact.path, "cpu"),
        shapes,
        goldens.compute(bundle, shapes, 0, reference_device="cpu"),
        validate.Tolerances("reference", atol=1e-4, rtol=1e-3, factor=3.0, floor=1e-6),
    )
    failed = sorted(result.shape["seq"] for result in report.failures())
    assert failed == sorted(shape["seq"] for shape in shapes if shape["seq"] < 128)
    assert len(failed) == len(shapes) - 1
    assert [r.passed for r in report.by_shape() if r.shape["seq"] == 128] == [True]


def test_an_input_above_its_bound_is_refused_with_the_bound(
    rms_norm: tuple[ModelBundle, Artifact],
) -> None:
    bundle, artifact = rms_norm
    program = WebgpuProgram(artifact.path, "cpu")
    with pytest.raises(InputOutOfBounds, match=r"dim 1 is 129, above its upper bound 128"):
        program.run(bundle.make_inputs({"seq": 129}, 0))
    with pytest.raises(InputOutOfBounds, match=r"rank 2 .* rank 3"):
        program.run((torch.randn(4, 64),))


def test_an_op_without_a_kernel_is_refused_when_the_program_loads(tmp_path: Path) -> None:
    # Lowered by ExecuTorch's own partitioner, which delegates leaky_relu: backend=webgpu's
    # lowering keeps it on the CPU (tests/test_webgpu_images.py).
    from executorch.backends.webgpu.partitioner import WebGPUPartitioner
    from executorch.exir import to_edge_transform_and_lower

    class LeakyRelu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.leaky_relu(x)

    program = torch.export.export(LeakyRelu(), (torch.randn(4, 8),))
    edge = to_edge_transform_and_lower(program, partitioner=[WebGPUPartitioner()])
    path = tmp_path / "leaky_relu.pte"
    path.write_bytes(edge.to_executorch().buffer)
    with pytest.raises(UnsupportedOp, match=r"GPU op\(s\) aten\.leaky_relu\.default: no kernel"):
        WebgpuProgram(path, "cpu")


def test_ops_kept_off_by_the_policy_run_on_the_cpu_between_delegates(tmp_path: Path) -> None:
    bundle, artifact = lowered(
        tmp_path, "model=rms_norm_residual", "fallback.ops=[aten.add.Tensor]"
    )
    assert artifact.partition is not None
    assert artifact.partition.ops_outside() == {"aten.add.Tensor": 1}
    program = WebgpuProgram(artifact.path, "cpu")
    for seq in (5, 128):
        inputs = bundle.make_inputs({"seq": seq}, 1)
        (got,) = program.run(inputs)
        assert (got - eager(bundle, inputs)).abs().max().item() < 1e-5


def test_llama_lowers_to_one_delegate_its_causal_mask_built_on_the_gpu(
    llama_job: CliResult,
) -> None:
    # Without the rewrites of exporter/backends/common/xnnpack_rewrites.py the boolean causal mask
    # and SDPA's decomposition stayed on the CPU, between five delegates of the default two
    # layers. One layer has the same mask and attention and lowers in about half the time. The
    # job's own .pte, loaded here: a lowering of its own would double this file's longest work.
    assert llama_job.exit_code == 0, llama_job.output[-3000:]
    partition = json.loads((llama_job.run_dir / "partition.json").read_text())
    assert partition["delegates"] == 1
    assert partition["ops_outside"] == {}
    job = composed(*ONE_LAYER_LLAMA)
    # Seeded as the job's: the same weights.
    bundle = models.build(job.model, job.dynamic)
    program = WebgpuProgram(llama_job.run_dir / "model.pte", "cpu")
    (delegate,) = program.delegates
    for seq in (128, 1, 77):
        inputs = bundle.make_inputs({"seq": seq}, seq)
        (got,) = program.run(inputs)
        assert got.shape == (1, seq, 512)
        assert (got - eager(bundle, inputs)).abs().max().item() < 1e-5
    assert len(delegate.recordings) == 3


def test_the_partitioners_pattern_graphs_are_built_once_a_process(
    rms_norm: tuple[ModelBundle, Artifact],
) -> None:
    # ExecuTorch 1.5 registers the builders uncached: each lowering exported the RoPE patterns
    # again, twice: most of a WebGPU lowering of a small program.
    from executorch.backends.vulkan.patterns import fusable_patterns

    builders = [e.get_graphs_fn for e in fusable_patterns.values() if e.get_graphs_fn]
    assert len(builders) >= 2
    for build in builders:
        assert build() is build()


def test_a_program_whose_input_is_named_input_is_rewritten_and_lowered(tmp_path: Path) -> None:
    # Copying the graph for the rewrites renames a placeholder named after a Python builtin.
    bundle, artifact = lowered(tmp_path, "model=linear")
    assert artifact.partition is not None
    assert artifact.partition.delegates == 1
    program = WebgpuProgram(artifact.path, "cpu")
    inputs = bundle.make_inputs({"m": 9}, 2)
    (got,) = program.run(inputs)
    assert (got - eager(bundle, inputs)).abs().max().item() < 1e-5


def test_a_block_under_min_block_size_stays_on_the_cpu_whole(tmp_path: Path) -> None:
    bundle, artifact = lowered(tmp_path, "model=rms_norm_residual", "fallback.min_block_size=8")
    assert artifact.partition is not None
    assert artifact.partition.delegates == 0
    assert artifact.partition.delegated_nodes == 0
    details = {node.detail for node in artifact.partition.nodes}
    assert details == {"its block had 7 compute node(s), under fallback.min_block_size=8"}
    program = WebgpuProgram(artifact.path, "cpu")
    assert program.delegates == []
    inputs = bundle.make_inputs({"seq": 9}, 2)
    (got,) = program.run(inputs)
    assert (got - eager(bundle, inputs)).abs().max().item() < 1e-5


def test_the_device_must_be_a_wgpu_adapter_choice() -> None:
    with pytest.raises(
        ConfigError, match=r"backend\.device=cuda: backend=webgpu runs on auto, gpu or cpu "
    ):
        composed("model=mlp", "backend.device=cuda")
    with pytest.raises(ConfigError, match=r"backend=eager runs on cpu or cuda"):
        composed("model=mlp", "backend=eager", "backend.device=gpu")


def test_gpu_without_a_hardware_gpu_is_a_configuration_error() -> None:
    if any(found.kind != "CPU" for found in adapter.available()):
        pytest.skip("this machine has a hardware GPU")
    with pytest.raises(ConfigError, match="finds no adapter for device=gpu"):
        backends.configured(composed("model=mlp", "backend.device=gpu")).check_target()


MODELS = [kind.value for kind in ToyKind] + ["mlp", "llama"]


def assert_passed_on_lavapipe(job_dir: Path, output: str, delegated_whole: bool = True) -> None:
    """The job of `job_dir` passed at every live shape on lavapipe; `output` is what it said."""
    report = json.loads((job_dir / "report.json").read_text())
    assert report["passed"], output[-3000:]
    assert len(report["shapes"]) == 7
    # Every shape ran twice on the one loaded program, then once more on a new one.
    instances = [e["instance"] for e in report["executions"]]
    assert instances.count("same instance") == 13 and instances.count("new instance") == 1
    assert report["target"]["adapter_type"] == "CPU"
    assert "llvmpipe" in report["target"]["adapter"]
    partition = json.loads((job_dir / "partition.json").read_text())
    if delegated_whole:
        assert partition["delegated_fraction"] == 1.0


@pytest.fixture(scope="module")
def llama_job(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    """The one-layer Llama through the command, as a user runs it: its run dir holds the .pte
    that test_llama_lowers_to_one_delegate_its_causal_mask_built_on_the_gpu loads."""
    return run_exporter(
        tmp_path_factory.mktemp("llama"), *ONE_LAYER_LLAMA, "backend=webgpu", "benchmark=off"
    )


def test_a_one_layer_llama_job_passes_at_every_live_shape_on_lavapipe(llama_job: CliResult) -> None:
    assert llama_job.exit_code == 0, llama_job.output
    assert_passed_on_lavapipe(llama_job.run_dir, llama_job.output)
    (run,) = llama_job.mlflow_runs()
    assert run.data.tags["target.adapter_backend"] == "Vulkan"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> SweepResult:
    workdir = tmp_path_factory.mktemp("webgpu_sweep")
    return run_sweep(
        workdir,
        workdir / "sweep",
        f"model={','.join(MODELS)}",
        "backend=webgpu",
        "backend.device=cpu",
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_every_model_passes_at_every_live_shape_on_lavapipe(sweep: SweepResult, model: str) -> None:
    (job_dir,) = sweep.sweep_dir.glob(f"*-{model}-webgpu")
    assert_passed_on_lavapipe(job_dir, sweep.output, delegated_whole=model != "gqa_attention")


@pytest.mark.slow
def test_the_sweep_logs_the_adapter_as_tags(sweep: SweepResult) -> None:
    assert sweep.exit_code == 0, sweep.output[-3000:]
    _, children = sweep.parent_and_children()
    assert len(children) == len(MODELS)
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.tags["target.adapter_backend"] == "Vulkan"
        assert run.data.tags["target.adapter_type"] == "CPU"
