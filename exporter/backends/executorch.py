"""ExecuTorch with the XNNPACK delegate: exported program -> edge dialect -> partitioned -> .pte,
run by ExecuTorch's runtime on the CPU.

The program is first rewritten into ops XNNPACK takes (exporter/lowering/xnnpack_rewrites.py),
and with `fallback.wrong_kernels=avoid` (the default) the ops XNNPACK computes as another
function into ops it computes right; the fallback policy maps onto XNNPACK's partitioner
(exporter/lowering/xnnpack_partitioner.py).
`external_weights` puts the weights into model.ptd beside model.pte
(exporter/lowering/executorch_program.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from exporter.config import BackendConfig, FallbackConfig, WrongKernels
from exporter.lowering.artifact import Artifact, Output

if TYPE_CHECKING:
    from exporter.export import Exported


@dataclass
class ExecutorchConfig(BackendConfig):
    name: str = "executorch"
    atol: float = 1.0e-4
    rtol: float = 1.0e-3
    # Weights in model.ptd, beside a model.pte that holds the program only: for weights past
    # what one flatbuffer addresses (2 GB), and a data file the runtime can map.
    external_weights: bool = False


SCHEMA = ExecutorchConfig
RUNTIME = "executorch"
AUDIT = "pte"
DELEGATE = "XNNPACK"


def check(backend: ExecutorchConfig, fallback: FallbackConfig) -> None:
    """ExecuTorch itself is one of the project's dependencies; XNNPACK is its CPU delegate."""


def output(backend: ExecutorchConfig) -> Output:
    return Output(
        file="model.pte",
        runtime=RUNTIME,
        audit=AUDIT,
        device="cpu",
        data_file="model.ptd" if backend.external_weights else None,
    )


def toolchain(backend: ExecutorchConfig) -> dict[str, str]:
    # ExecuTorch's version is among the libraries its lowering code imports.
    return {}


def lower(
    exported: Exported, backend: ExecutorchConfig, fallback: FallbackConfig, out_dir: Path
) -> Artifact:
    from exporter.lowering.executorch_program import announced_policy, lowered_to_pte
    from exporter.lowering.xnnpack_partitioner import PolicyPartitioner
    from exporter.lowering.xnnpack_rewrites import (
        ViewsForXnnpack,
        for_xnnpack,
        without_wrong_kernels,
    )

    partitioner = PolicyPartitioner(announced_policy("XNNPACK", fallback, exported))
    program = for_xnnpack(exported.program)
    avoided = ()
    if fallback.wrong_kernels is WrongKernels.avoid:
        program, avoided = without_wrong_kernels(program)
    return lowered_to_pte(
        replace(exported, program=program),
        partitioner,
        partitioner.why_on_cpu,
        output(backend),
        out_dir,
        edge_passes=[ViewsForXnnpack()],
        wrong_kernels_avoided=avoided,
    )
