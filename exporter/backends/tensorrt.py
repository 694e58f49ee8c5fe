"""TensorRT through torch-tensorrt's dynamo path: the exported program, moved to CUDA, compiled by
`torch_tensorrt.dynamo.compile` with one optimization profile per input (min/opt/max from the
declared dims), and written by `torch_tensorrt.save` in `backend.output_format`.

Written against torch-tensorrt 2.14.0, the release built for torch 2.14. TensorRT cannot be
installed where this project is developed, so the parts that need it (compile, save, load) have
not run here; everything before them (settings, profiles, checks, reading the partition from the
module compile returns) is tested without it.

The fallback policy maps onto four CompilationSettings fields (`policy_settings`). Which node
runs where is read from the module compile returns, partitioned by torch-tensorrt's partitioner:
each TensorRT engine is a `_run_on_acc_*` submodule, and the nodes left to PyTorch are in
`_run_on_gpu_*` submodules or in the top graph (`partition_of`). A build replaces each engine's
graph by the engine, so the lowering first compiles with `dryrun`, which partitions alike and
builds nothing (torch-tensorrt's own workflow: dry run, then compile), and builds after it;
torch-tensorrt writes the dry run's report to tensorrt_report.txt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import io
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from exporter.artifact import Artifact, Output, WeightsReader
from exporter.artifact.partition import (
    DELEGATED,
    SMALL_BLOCK,
    UNSUPPORTED,
    NodePlacement,
    PartitionSummary,
)
from exporter.backends.common.declaration import Backend
from exporter.config import BackendConfig, FallbackConfig, FallbackPolicy
from exporter.errors import ConfigError, LoweringFailed

if TYPE_CHECKING:
    import torch

    from exporter.export import Exported
    from exporter.export.shapes import InputProfile

log = logging.getLogger(__name__)


class TensorrtOutputFormat(Enum):
    """What torch_tensorrt.save writes: a torch.export program with the engines inside (.ep), an
    ExecuTorch program with TensorRT delegates (.pte), or an AOTInductor package (.pt2)."""

    exported_program = "exported_program"
    executorch = "executorch"
    aot_inductor = "aot_inductor"


# CompilationSettings fields the fallback policy owns, and the fallback key that sets each.
POLICY_SETTINGS = {
    "min_block_size": "fallback.min_block_size",
    "torch_executed_ops": "fallback.ops",
    "require_full_compilation": "fallback=strict",
    "fallback_data_dependent_ops": "fallback=data_dependent",
    "dryrun": "backend.dryrun",
}


@dataclass
class TensorrtConfig(BackendConfig):
    """torch-tensorrt's dynamo path on CUDA. `settings` are torch_tensorrt.dynamo.compile's
    keyword arguments (the fields of its CompilationSettings), checked against the installed
    release; the fallback policy and `dryrun` set the ones in POLICY_SETTINGS."""

    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    quant_refusal: ClassVar[str] = (
        "TensorRT quantizes with its own recipes (NVIDIA ModelOpt's Q/DQ nodes), not "
        "torchao's tensors, and this lowering maps none of torchao's ops: nothing here was "
        "checked to compute right."
    )

    name: str = "tensorrt"
    atol: float = 1.0e-3
    rtol: float = 1.0e-2
    device: str = "cuda"
    output_format: TensorrtOutputFormat = TensorrtOutputFormat.exported_program
    # Partition only, build no engine: the report says what would run in TensorRT.
    dryrun: bool = False
    settings: dict[str, Any] = field(default_factory=lambda: {"optimization_level": 3})

    def __post_init__(self) -> None:
        super().__post_init__()
        owned = sorted(self.settings.keys() & POLICY_SETTINGS.keys())
        if owned:
            raise ConfigError(
                "; ".join(f"backend.settings.{k} is set by {POLICY_SETTINGS[k]}" for k in owned)
                + ". Each is set in one place only: remove it from backend.settings."
            )


DELEGATE = "TensorRT"
# Where the nodes outside every engine run.
OUTSIDE = "pytorch"
REPORT_FILE = "tensorrt_report.txt"
INSTALL = (
    "pip install torch-tensorrt==2.14.0, which brings TensorRT 11.1 for CUDA 13 "
    "(tensorrt-cu13; its libraries download from NVIDIA's index, pypi.nvidia.com)"
)

# The file each format is saved as; runtimes/loaders/tensorrt.py loads each by its suffix.
_FILES = {
    TensorrtOutputFormat.exported_program: "model.ep",
    TensorrtOutputFormat.executorch: "model.pte",
    TensorrtOutputFormat.aot_inductor: "model.pt2",
}

# Settings that releases removed, and what replaced them; named in the error for each.
_REMOVED = {
    "enabled_precisions": (
        "removed in torch-tensorrt 2.13: networks are strongly typed and precision follows the "
        "model's dtype; for lower precision set backend.settings.enable_autocast=true "
        "backend.settings.autocast_low_precision_type=float16 (or bfloat16)"
    ),
    "use_explicit_typing": "removed in torch-tensorrt 2.13: networks are always strongly typed",
}
_AUTOCAST_TYPES = ("float16", "bfloat16")

# The names torch-tensorrt's partitioners give the submodules of the module compile returns: an
# engine's (both partitioners), and a graph of nodes left to PyTorch (the adjacency partitioner,
# the default; the global one leaves those nodes in the top graph).
ENGINE_SUBMODULE = "_run_on_acc_"
PYTORCH_SUBMODULE = "_run_on_gpu_"


class Tensorrt(Backend):
    def output(self, config: TensorrtConfig) -> Output:
        if config.dryrun:
            return Output(file=REPORT_FILE, runtime=None, audit=self.audit, device="cuda")
        return Output(
            file=_FILES[config.output_format],
            runtime=self.runtime,
            audit=self.audit,
            device="cuda",
        )

    def check(self, config: TensorrtConfig, fallback: FallbackConfig) -> None:
        """Contradictions first (they need nothing installed), then torch-tensorrt and TensorRT,
        the settings against the installed CompilationSettings, and a CUDA device."""
        from exporter.backends.common import torch_device

        check_policy(config, fallback)
        torch_tensorrt = _import_torch_tensorrt()
        compile_settings(config, fallback, settings_fields(), torch_tensorrt.__version__)
        torch_device.require("cuda")

    def toolchain(self, config: TensorrtConfig) -> dict[str, str]:
        import tensorrt

        from exporter.backends.common import torch_device

        return {
            "torch_tensorrt": importlib.metadata.version("torch-tensorrt"),
            "tensorrt": tensorrt.__version__,
            "device": torch_device.describe("cuda"),
        }

    def lower(
        self, exported: Exported, config: TensorrtConfig, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        import torch_tensorrt
        from torch.export.passes import move_to_device_pass

        from exporter.backends.common import torch_device

        settings = compile_settings(config, fallback, settings_fields(), torch_tensorrt.__version__)
        inputs = [trt_input(profile) for profile in exported.inputs]
        report = out_dir / REPORT_FILE
        log.info(
            "[lower] TensorRT: torch_tensorrt.dynamo.compile%s with %s",
            " (dry run)" if config.dryrun else "",
            ", ".join(f"{p.name} {p.min_shape}..{p.max_shape}" for p in exported.inputs),
        )
        program = move_to_device_pass(exported.program, torch_device.indexed("cuda"))

        def compile_program(dryrun: bool | str) -> torch.fx.GraphModule:
            try:
                return torch_tensorrt.dynamo.compile(
                    program, arg_inputs=inputs, dryrun=dryrun, **settings
                )
            except AssertionError as error:
                if "require_full_compilation" not in str(error):
                    raise
                raise LoweringFailed(
                    f"fallback=strict: TensorRT cannot run the whole program ({error}). Run "
                    "backend.dryrun=true to see which ops stay outside, or use fallback=auto."
                ) from error

        # The dry run writes its report to `report` and prints it too: on stdout it would only
        # repeat, unlogged, what the partition's description logs below.
        with contextlib.redirect_stdout(io.StringIO()):
            planned = compile_program(str(report))
        built = planned if config.dryrun else compile_program(False)
        partition = partition_of(
            built, planned, fallback, _data_dependent_ops(program), _converter_takes
        )
        log.info("[lower] %s", partition.describe())
        if not report.exists():
            # torch-tensorrt writes no report for a graph it converts none of.
            report.write_text(partition.describe() + "\n")
        target = self.output(config)
        if config.dryrun:
            return Artifact.at(report, target, partition)
        path = out_dir / target.file
        # out_dir is a staging folder nobody reads before lowering returns, so save writes in place
        # (the executorch format writes one .pte holding the program and the engines as data).
        extra = (
            {"pickle_protocol": 4}
            if config.output_format is TensorrtOutputFormat.exported_program
            else {}
        )
        torch_tensorrt.save(
            built,
            str(path),
            output_format=config.output_format.value,
            arg_inputs=inputs,
            retrace=True,
            **extra,
        )
        return Artifact.at(path, target, partition)


def check_policy(backend: TensorrtConfig, fallback: FallbackConfig) -> None:
    """An ExecuTorch program cannot hold an engine whose output shape depends on data, so that
    format needs those ops in PyTorch (fallback_data_dependent_ops)."""
    if backend.output_format is not TensorrtOutputFormat.executorch:
        return
    if fallback.policy is FallbackPolicy.strict:
        raise ConfigError(
            "backend.output_format=executorch runs data-dependent ops outside TensorRT "
            "(fallback_data_dependent_ops), and fallback=strict requires full compilation "
            "(require_full_compilation): they contradict. Use fallback=data_dependent, or "
            "backend.output_format=exported_program with fallback=strict."
        )
    if fallback.policy is not FallbackPolicy.data_dependent:
        raise ConfigError(
            f"backend.output_format=executorch requires fallback=data_dependent (it is "
            f"fallback={fallback.policy.value}): ExecuTorch's TensorRT delegate cannot run an "
            "engine whose output shape depends on tensor values."
        )


def settings_fields() -> set[str]:
    from torch_tensorrt.dynamo import CompilationSettings

    return {field.name for field in dataclasses.fields(CompilationSettings)}


def compile_settings(
    backend: TensorrtConfig,
    fallback: FallbackConfig,
    fields: Collection[str],
    release: str,
) -> dict[str, Any]:
    """The keyword arguments of dynamo.compile: `backend.settings`, every one a field of the
    installed release's CompilationSettings, and the fallback policy's four."""
    unknown = sorted(set(backend.settings) - set(fields))
    if unknown:
        reasons = [
            f"backend.settings.{key}: {_REMOVED.get(key, 'no such field')}" for key in unknown
        ]
        raise ConfigError(
            f"{'; '.join(reasons)}. torch-tensorrt {release}'s CompilationSettings has: "
            f"{', '.join(sorted(fields))}."
        )
    settings = {key: _setting(key, value) for key, value in backend.settings.items()}
    return {**settings, **policy_settings(fallback)}


def policy_settings(fallback: FallbackConfig) -> dict[str, Any]:
    return {
        "min_block_size": fallback.min_block_size,
        # torch-tensorrt matches a node's target by its qualified name.
        "torch_executed_ops": {f"torch.ops.{op}" for op in fallback.ops},
        "require_full_compilation": fallback.policy is FallbackPolicy.strict,
        "fallback_data_dependent_ops": fallback.policy is FallbackPolicy.data_dependent,
    }


def _setting(key: str, value: Any) -> Any:
    if key != "autocast_low_precision_type" or value is None:
        return value
    if value not in _AUTOCAST_TYPES:
        raise ConfigError(
            f"backend.settings.autocast_low_precision_type is {value!r}; allowed: "
            f"{', '.join(_AUTOCAST_TYPES)}."
        )
    import torch

    return getattr(torch, value)


def trt_input(profile: InputProfile) -> Any:
    """torch_tensorrt.Input for one input's profile; dims shared by inputs keep one name."""
    import torch_tensorrt

    if profile.min_shape == profile.max_shape:
        return torch_tensorrt.Input(shape=profile.min_shape, dtype=profile.dtype, name=profile.name)
    return torch_tensorrt.Input(
        min_shape=profile.min_shape,
        opt_shape=profile.opt_shape,
        max_shape=profile.max_shape,
        dtype=profile.dtype,
        name=profile.name,
        shared_dims=profile.dims,
    )


def partition_of(
    built: torch.fx.GraphModule,
    planned: torch.fx.GraphModule,
    fallback: FallbackConfig,
    data_dependent_ops: Collection[str],
    converter_takes: Callable[[torch.fx.Node], bool],
) -> PartitionSummary:
    """Where each compute node runs, read from the module torch_tensorrt.dynamo.compile returned
    (`built`). Each `_run_on_acc_*` submodule there is an engine, whose nodes are those of the
    submodule of that name in the dry run's module (`planned`, where it is still a graph; after
    a dry run alone, `built` itself). The other compute nodes run in PyTorch, in a
    `_run_on_gpu_*` submodule or in the top graph: where torch-tensorrt built no engine, it
    returned the graph whole. A node in PyTorch is there for the policy's reason, or because no
    converter takes it (`converter_takes`), or else because the partitioner left its block out
    of every engine (`fallback.min_block_size`)."""
    from exporter.backends.common.policy import is_compute, op_name, policy_reason

    def in_pytorch(node: torch.fx.Node) -> NodePlacement:
        op = op_name(node)
        reason, detail = (
            policy_reason({op}, op in data_dependent_ops, fallback)
            or (None if converter_takes(node) else (UNSUPPORTED, "no TensorRT converter takes it"))
            or (
                SMALL_BLOCK,
                "a converter takes it, but its block went to no engine (min_block_size)",
            )
        )
        return NodePlacement(node.name, op, OUTSIDE, reason, detail)

    def compute_nodes(submodule: str, module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [node for node in module.get_submodule(submodule).graph.nodes if is_compute(node)]

    nodes: list[NodePlacement] = []
    engines = 0
    for node in built.graph.nodes:
        if node.op == "call_module" and node.target.startswith(ENGINE_SUBMODULE):
            engines += 1
            nodes += [
                NodePlacement(inner.name, op_name(inner), DELEGATE, DELEGATED)
                for inner in compute_nodes(node.target, planned)
            ]
        elif node.op == "call_module" and node.target.startswith(PYTORCH_SUBMODULE):
            nodes += [in_pytorch(inner) for inner in compute_nodes(node.target, built)]
        elif is_compute(node):
            nodes.append(in_pytorch(node))
    return PartitionSummary(nodes=tuple(nodes), delegates=engines)


def _converter_takes(node: torch.fx.Node) -> bool:
    """Whether a TensorRT converter takes the node: the partitioner's own test, a converter
    registered for its op whose capability validator accepts this node."""
    from torch_tensorrt.dynamo.conversion import DYNAMO_CONVERTERS

    return node in DYNAMO_CONVERTERS


def _data_dependent_ops(program: torch.export.ExportedProgram) -> set[str]:
    from exporter.backends.common.policy import makes_data_dependent_shape, op_name

    return {op_name(node) for node in program.graph.nodes if makes_data_dependent_shape(node)}


BACKEND = Tensorrt(
    schema=TensorrtConfig,
    runtime="tensorrt",
    delegate=DELEGATE,
    audit=WeightsReader.tensorrt_engine,
)


def _import_torch_tensorrt() -> Any:
    """torch_tensorrt, or a ConfigError saying what is missing and how to install it."""
    try:
        import torch_tensorrt
    except ModuleNotFoundError as error:
        if error.name != "torch_tensorrt":
            raise _missing_tensorrt(error) from error
        raise ConfigError(
            f"backend=tensorrt needs torch-tensorrt, which is not installed here: {INSTALL}. "
            "Other backends need neither: backend=aoti backend.device=cuda compiles for the GPU "
            "with PyTorch alone."
        ) from None
    except Exception as error:
        # Without TensorRT's libraries torch-tensorrt's import raises a bare Exception.
        raise _missing_tensorrt(error) from error
    return torch_tensorrt


def _missing_tensorrt(error: Exception) -> ConfigError:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ConfigError(
        f"backend=tensorrt: torch-tensorrt is installed, but TensorRT is not ({first_line}). "
        f"Install it: {INSTALL}."
    )
