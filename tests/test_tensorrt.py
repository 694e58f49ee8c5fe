"""backend=tensorrt without TensorRT: the settings a config makes, the shape profiles, the checks
and errors, and the partition read from modules shaped as torch_tensorrt.dynamo.compile returns
them, partitioned here by the torch.fx passes torch-tensorrt's partitioners use."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
from torch.fx.passes.split_utils import split_by_tags
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from exporter import config, models
from exporter.artifact.partition import (
    DATA_DEPENDENT,
    DELEGATED,
    NAMED,
    SMALL_BLOCK,
    UNSUPPORTED,
    PartitionSummary,
)
from exporter.backends import tensorrt
from exporter.backends.tensorrt import TensorrtConfig, TensorrtOutputFormat
from exporter.config import DimMode, FallbackConfig, FallbackPolicy
from exporter.errors import ConfigError
from exporter.export.shapes import opt_size, profiles
from exporter.models import DynamicDim, ModelBundle
from tests.conftest import CliResult
from tests.test_cli import assert_user_error
from tests.test_config import composed

# The fields of torch_tensorrt.dynamo.CompilationSettings in torch-tensorrt 2.14.0, read from
# the release's torch_tensorrt/dynamo/_settings.py: the input the settings check is given where
# torch-tensorrt is installed (`tensorrt.settings_fields()`).
FIELDS_2_14 = frozenset(
    [
        "workspace_size",
        "min_block_size",
        "torch_executed_ops",
        "pass_through_build_failures",
        "max_aux_streams",
        "version_compatible",
        "optimization_level",
        "truncate_double",
        "use_complex_decomposition",
        "use_fast_partitioner",
        "enable_experimental_decompositions",
        "device",
        "require_full_compilation",
        "disable_tf32",
        "assume_dynamic_shape_support",
        "sparse_weights",
        "engine_capability",
        "num_avg_timing_iters",
        "dla_sram_size",
        "dla_local_dram_size",
        "dla_global_dram_size",
        "dryrun",
        "hardware_compatible",
        "timing_cache_path",
        "lazy_engine_init",
        "cache_built_engines",
        "reuse_cached_engines",
        "use_fp32_acc",
        "refit_identical_engine_weights",
        "strip_engine_weights",
        "immutable_weights",
        "enable_weight_streaming",
        "enable_cross_compile_for_windows",
        "tiling_optimization_level",
        "l2_limit_for_tiling",
        "use_distributed_mode_trace",
        "offload_module_to_cpu",
        "enable_autocast",
        "autocast_low_precision_type",
        "autocast_excluded_nodes",
        "autocast_excluded_ops",
        "autocast_max_output_threshold",
        "autocast_max_depth_of_reduction",
        "autocast_calibration_dataloader",
        "enable_resource_partitioning",
        "cpu_memory_budget",
        "dynamically_allocate_resources",
        "decompose_attention",
        "disabled_constant_fold_exclusions",
        "attn_bias_is_causal",
        "fallback_data_dependent_ops",
    ]
)


def job_of(*overrides: str) -> config.JobConfig:
    return config.to_job(composed("backend=tensorrt", *overrides))


def settings_of(*overrides: str) -> dict:
    job = job_of(*overrides)
    return tensorrt.compile_settings(job.backend, job.fallback, FIELDS_2_14, "2.14.0")


def test_the_config_group_composes_the_documented_defaults() -> None:
    job = job_of()
    assert isinstance(job.backend, TensorrtConfig)
    assert job.backend.output_format is TensorrtOutputFormat.exported_program
    assert job.backend.dryrun is False
    assert set(job.backend.settings) <= FIELDS_2_14


def test_settings_pass_through_and_the_fallback_policy_sets_its_four_fields() -> None:
    settings = settings_of(
        "backend.settings.optimization_level=5",
        "+backend.settings.disable_tf32=true",
        "fallback.ops=[aten.nonzero.default]",
        "fallback.min_block_size=3",
    )
    assert settings == {
        "optimization_level": 5,
        "disable_tf32": True,
        "min_block_size": 3,
        "torch_executed_ops": {"torch.ops.aten.nonzero.default"},
        "require_full_compilation": False,
        "fallback_data_dependent_ops": False,
    }
    strict = settings_of("fallback=strict")
    assert (strict["require_full_compilation"], strict["fallback_data_dependent_ops"]) == (
        True,
        False,
    )
    assert strict["torch_executed_ops"] == set()
    data_dependent = settings_of("fallback=data_dependent")
    assert (
        data_dependent["require_full_compilation"],
        data_dependent["fallback_data_dependent_ops"],
    ) == (
        False,
        True,
    )


def test_autocast_precision_is_a_torch_dtype_named_in_the_config() -> None:
    settings = settings_of(
        "+backend.settings.enable_autocast=true",
        "+backend.settings.autocast_low_precision_type=bfloat16",
    )
    assert settings["autocast_low_precision_type"] is torch.bfloat16
    with pytest.raises(
        ConfigError, match=r"autocast_low_precision_type is 'int8'; allowed: float16, bfloat16"
    ):
        settings_of("+backend.settings.autocast_low_precision_type=int8")


def test_a_removed_setting_is_an_error_that_says_what_replaced_it() -> None:
    with pytest.raises(ConfigError) as error:
        settings_of("+backend.settings.enabled_precisions=[float16]")
    message = str(error.value)
    assert "backend.settings.enabled_precisions: removed in torch-tensorrt 2.13" in message
    assert "backend.settings.enable_autocast=true" in message
    assert "torch-tensorrt 2.14.0's CompilationSettings has:" in message


def test_an_unknown_setting_is_named_never_dropped() -> None:
    with pytest.raises(ConfigError, match=r"backend.settings.optimisation_level: no such field"):
        settings_of("+backend.settings.optimisation_level=3")


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        ("min_block_size", "fallback.min_block_size"),
        ("torch_executed_ops", "fallback.ops"),
        ("require_full_compilation", "fallback=strict"),
        ("fallback_data_dependent_ops", "fallback=data_dependent"),
        ("dryrun", "backend.dryrun"),
    ],
)
def test_a_setting_the_policy_owns_is_refused_in_backend_settings(key: str, owner: str) -> None:
    with pytest.raises(ConfigError, match=rf"backend.settings.{key} is set by {owner}"):
        job_of(f"+backend.settings.{key}=1")


def test_the_executorch_format_needs_the_data_dependent_fallback() -> None:
    job = job_of("backend.output_format=executorch", "fallback=strict")
    with pytest.raises(ConfigError, match="they contradict"):
        tensorrt.check_policy(job.backend, job.fallback)
    job = job_of("backend.output_format=executorch")
    with pytest.raises(ConfigError, match="requires fallback=data_dependent"):
        tensorrt.check_policy(job.backend, job.fallback)
    job = job_of("backend.output_format=executorch", "fallback=data_dependent")
    tensorrt.check_policy(job.backend, job.fallback)
    assert tensorrt.compile_settings(job.backend, job.fallback, FIELDS_2_14, "2.14.0")[
        "fallback_data_dependent_ops"
    ]


@pytest.mark.parametrize(
    ("output_format", "file"),
    [
        ("exported_program", "model.ep"),
        ("executorch", "model.pte"),
        ("aot_inductor", "model.pt2"),
    ],
)
def test_each_output_format_has_its_file_and_runtime(output_format: str, file: str) -> None:
    job = job_of(f"backend.output_format={output_format}", "fallback=data_dependent")
    output = tensorrt.BACKEND.output(job.backend)
    assert (output.file, output.runtime, output.device) == (file, "tensorrt", "cuda")
    dry = tensorrt.BACKEND.output(job_of("backend.dryrun=true").backend)
    assert (dry.file, dry.runtime) == (tensorrt.REPORT_FILE, None)


def bundle_with(dims: tuple[DynamicDim, ...]) -> ModelBundle:
    """Token ids and a mask that share `tokens`, and a static 8-wide feature axis."""

    def make_inputs(sizes: dict[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        tokens, batch = sizes["tokens"], sizes.get("batch", 1)
        return torch.zeros(batch, tokens, dtype=torch.int64), torch.ones(batch, tokens, 8)

    return ModelBundle(
        name="pair",
        module=torch.nn.Identity(),
        input_names=("ids", "mask"),
        output_names=("out",),
        dims=dims,
        make_inputs=make_inputs,
    )


def test_profiles_span_the_declared_bounds_with_opt_strictly_between() -> None:
    tokens = DynamicDim("tokens", (("ids", 1), ("mask", 1)), 1, 128, DimMode.backed)
    batch = DynamicDim("batch", (("ids", 0), ("mask", 0)), 4, 4, DimMode.backed)
    ids, mask = profiles(bundle_with((tokens, batch)))
    assert (ids.name, ids.dtype) == ("ids", torch.int64)
    assert (ids.min_shape, ids.opt_shape, ids.max_shape) == ((4, 1), (4, 64), (4, 128))
    assert (mask.min_shape, mask.opt_shape, mask.max_shape) == ((4, 1, 8), (4, 64, 8), (4, 128, 8))
    # The shared dim has one name on both inputs; the static batch is no dynamic axis.
    assert ids.dims == mask.dims == {1: "tokens"}
    assert mask.dtype == torch.float32


@pytest.mark.parametrize(
    ("low", "high", "opt"), [(1, 128, 64), (1, 3, 2), (7, 9, 8), (5, 6, 6), (4, 4, 4)]
)
def test_opt_lies_strictly_inside_every_range_that_has_an_inside(
    low: int, high: int, opt: int
) -> None:
    dim = DynamicDim("seq", (("ids", 1),), low, high)
    assert opt_size(dim) == opt
    if high - low >= 2:
        assert low < opt_size(dim) < high


def test_profiles_of_the_llama_follow_dynamic_seq() -> None:
    job = config.to_job(composed("model=llama", "dynamic.seq.min=2", "dynamic.seq.max=100"))
    (ids,) = profiles(models.build(job.model, job.dynamic))
    assert (ids.min_shape, ids.opt_shape, ids.max_shape) == ((1, 2), (1, 51), (1, 100))
    assert ids.dims == {1: "seq"}


def test_profiles_of_a_kv_cache_llama_share_seq_between_ids_and_positions() -> None:
    # One dim across both inputs: an engine built for ids and positions of different lengths
    # would accept calls the cache cannot take.
    job = config.to_job(composed("model=llama", "model.kv_cache=static", "dynamic.seq.max=16"))
    ids, positions = profiles(models.build(job.model, job.dynamic))
    assert (ids.name, ids.min_shape, ids.opt_shape, ids.max_shape) == (
        "input_ids",
        (1, 1),
        (1, 8),
        (1, 16),
    )
    assert (positions.name, positions.dtype) == ("cache_position", torch.int64)
    assert (positions.min_shape, positions.opt_shape, positions.max_shape) == ((1,), (8,), (16,))
    assert (ids.dims, positions.dims) == ({1: "seq"}, {0: "seq"})


class Partitioned(torch.nn.Module):
    """Two engines' worth of ops (linear and relu; mul) around a subtraction and a nonzero, whose
    output size depends on the data, which stay in PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x).relu() - 1
        return y * 2, torch.nonzero(y)


ENGINES = (("linear", "relu"), ("mul",))


def program_module() -> torch.fx.GraphModule:
    """The graph torch-tensorrt partitions: the exported program as a module."""
    program = torch.export.export(Partitioned(), (torch.randn(4, 8),))
    return program.module(check_guards=False)


def adjacency_partitioned() -> torch.fx.GraphModule:
    """As torch-tensorrt's default partitioner returns it: torch.fx's splitter tags each run of
    nodes `_run_on_acc_<i>` (an engine) or `_run_on_gpu_<i>` (PyTorch) and splits the graph into
    a submodule per tag (torch.fx.passes.splitter_base._SplitterBase's tag and split)."""
    module = program_module()
    tags = ["_run_on_acc_0", "_run_on_gpu_1", "_run_on_acc_2"]
    for node in module.graph.nodes:
        if node.op == "call_function":
            engine = next((i for i, names in enumerate(ENGINES) if node.name in names), None)
            node.tag = tags[1] if engine is None else tags[2 * engine]
    return split_by_tags(module, tags)


def global_partitioned() -> torch.fx.GraphModule:
    """As torch-tensorrt's global partitioner returns it: each engine's nodes fused into a
    `_run_on_acc_<i>` submodule (torch.fx's CapabilityBasedPartitioner.fuse_partitions), the
    nodes left to PyTorch in the top graph."""
    module = program_module()
    nodes = {node.name: node for node in module.graph.nodes}
    engines = [dict.fromkeys(nodes[name] for name in names) for names in ENGINES]
    return fuse_by_partitions(module, engines, prefix=tensorrt.ENGINE_SUBMODULE)


def built_from(planned: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """What a build returns: the same partition, each engine's graph replaced by an engine, a
    module without a graph (torch_tensorrt.runtime.TorchTensorRTModule)."""
    for name, _ in list(planned.named_children()):
        if name.startswith(tensorrt.ENGINE_SUBMODULE):
            setattr(planned, name, torch.nn.Module())
    return planned


def no_nonzero_converter(node: torch.fx.Node) -> bool:
    return node.target is not torch.ops.aten.nonzero.default


def reasons_of(summary: PartitionSummary) -> dict[str, tuple[str, str, str]]:
    return {node.node: (node.op, node.placement, node.reason) for node in summary.nodes}


@pytest.mark.parametrize("partitioned", [adjacency_partitioned, global_partitioned])
@pytest.mark.parametrize("dryrun", [True, False], ids=["dry run", "build"])
def test_the_partitioned_module_gives_each_compute_node_its_place_and_reason(
    partitioned: Callable[[], torch.fx.GraphModule], dryrun: bool
) -> None:
    planned = partitioned()
    built = planned if dryrun else built_from(partitioned())
    summary = tensorrt.partition_of(
        built, planned, FallbackConfig(policy=FallbackPolicy.auto), set(), no_nonzero_converter
    )
    # The size arithmetic on nonzero's count and the asserts on it are no compute nodes.
    assert reasons_of(summary) == {
        "linear": ("aten.linear.default", "TensorRT", DELEGATED),
        "relu": ("aten.relu.default", "TensorRT", DELEGATED),
        "sub": ("aten.sub.Tensor", "pytorch", SMALL_BLOCK),
        "mul": ("aten.mul.Tensor", "TensorRT", DELEGATED),
        "nonzero": ("aten.nonzero.default", "pytorch", UNSUPPORTED),
    }
    assert (summary.delegates, summary.delegated_nodes, summary.fallback_op_count) == (2, 3, 2)
    assert "no TensorRT converter takes it: aten.nonzero.default" in summary.describe()


def test_the_policys_reasons_come_before_the_converters() -> None:
    fallback = FallbackConfig(policy=FallbackPolicy.data_dependent, ops=["aten.sub.Tensor"])
    summary = tensorrt.partition_of(
        adjacency_partitioned(),
        adjacency_partitioned(),
        fallback,
        {"aten.nonzero.default"},
        no_nonzero_converter,
    )
    outside = {node: reason for node, (_, _, reason) in reasons_of(summary).items()}
    assert (outside["sub"], outside["nonzero"]) == (NAMED, DATA_DEPENDENT)


def test_a_graph_built_without_engines_runs_whole_in_pytorch() -> None:
    # torch-tensorrt returns the graph unpartitioned where it builds no engine, though its dry
    # run partitioned it: a graph whose supported ops are fewer than min_block_size.
    summary = tensorrt.partition_of(
        program_module(),
        adjacency_partitioned(),
        FallbackConfig(policy=FallbackPolicy.auto),
        set(),
        no_nonzero_converter,
    )
    assert (summary.delegates, summary.delegated_nodes, summary.fallback_op_count) == (0, 0, 5)
    assert reasons_of(summary)["nonzero"][2] == UNSUPPORTED
    assert {reasons_of(summary)[name][2] for name in ("linear", "relu", "sub", "mul")} == {
        SMALL_BLOCK
    }


@pytest.mark.skipif(
    importlib.util.find_spec("torch_tensorrt") is not None, reason="torch-tensorrt is installed"
)
def test_without_torch_tensorrt_the_job_exits_2_before_any_work(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("backend=tensorrt", "model=mlp")
    assert_user_error(
        result, 2, "backend=tensorrt needs torch-tensorrt", "pip install torch-tensorrt==2.14.0"
    )
    assert "[export] started" not in result.output
    assert not (result.run_dir / "program.pt2").exists()
    # Refused before its work began: a single job records no MLflow run.
    assert result.mlflow_runs() == []


@pytest.mark.skipif(
    importlib.util.find_spec("torch_tensorrt") is not None, reason="torch-tensorrt is installed"
)
def test_a_kv_cache_model_composes_and_exits_2_naming_what_tensorrt_needs(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("backend=tensorrt", "model.kv_cache=static", "dynamic.seq.max=16")
    assert_user_error(
        result, 2, "backend=tensorrt needs torch-tensorrt", "pip install torch-tensorrt==2.14.0"
    )
    assert not (result.run_dir / "program.pt2").exists()


def test_a_contradiction_exits_2_whether_or_not_torch_tensorrt_is_installed(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(
        "backend=tensorrt", "model=moe", "backend.output_format=executorch", "fallback=strict"
    )
    assert_user_error(result, 2, "require_full_compilation", "they contradict")
