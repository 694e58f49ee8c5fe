"""AOTInductor: torch._inductor compiles the exported program, its dynamic dims kept, into a .pt2
package of native code (C++ on the CPU, Triton kernels on CUDA) that `aoti_load_package` runs.

Inductor compiles every op of the program, data-dependent ones included (nonzero's count becomes
a runtime size), so nothing is partitioned and nothing falls back.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from exporter.artifact import Artifact, Output, WeightsReader
from exporter.backends.common.declaration import Backend
from exporter.config import BackendConfig, EmbeddingQuant, FallbackConfig, QuantScheme
from exporter.errors import ConfigError
from exporter.files import atomic_path
from exporter.process import progress

if TYPE_CHECKING:
    from exporter.export import Exported

log = logging.getLogger(__name__)


@dataclass
class AotiConfig(BackendConfig):
    """`device=cuda` compiles Triton kernels for the GPU this machine has."""

    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    runtime_guards_refusal: ClassVar[str] = ""
    # torchao's quantized layers run as PyTorch computes them (Inductor compiles the
    # dequantization into its kernels); int4_weight and quantize=auto's layers through
    # PyTorch's int4 kernel.
    quant_schemes: ClassVar[tuple[QuantScheme, ...]] = tuple(QuantScheme)
    embedding_quants: ClassVar[tuple[EmbeddingQuant, ...]] = tuple(EmbeddingQuant)
    int4_weight_packed: ClassVar[bool] = True

    name: str = "aoti"
    atol: float = 1.0e-4
    rtol: float = 1.0e-3
    device: str = "cpu"

    def quantize_recipes(self) -> tuple[str, ...]:
        # PyTorch's packed int4 kernel (which holds a GGUF file's 4-bit and 8-bit codes): the
        # CPU's, repacked for CUDA's on CUDA (runtimes/int4_kernels.py).
        return ("int4_g128", "int4", "int8", "float")


class Aoti(Backend):
    def check(self, config: AotiConfig, fallback: FallbackConfig) -> None:
        from exporter.backends.common import torch_device

        torch_device.require(config.device)
        _compiler()

    def output(self, config: AotiConfig) -> Output:
        return Output(
            file="model.pt2", runtime=self.runtime, audit=self.audit, device=config.device
        )

    def toolchain(self, config: AotiConfig) -> dict[str, str]:
        from exporter.backends.common import torch_device

        compiler = _compiler()
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        return {
            "device": torch_device.describe(config.device),
            "compiler": version[0] if version else "",
            # Where the package keeps the weights: it changes the artifact, so it is in the key.
            "weights": ",".join(f"{k}={v}" for k, v in sorted(_inductor_configs().items())),
        }

    def lower(
        self, exported: Exported, config: AotiConfig, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        from torch._inductor import aoti_compile_and_package
        from torch.export.passes import move_to_device_pass

        from exporter.backends.common import torch_device
        from runtimes import int4_kernels

        if fallback.ops or fallback.min_block_size > 1:
            log.warning(
                "[lower] backend=aoti compiles every op into the package; fallback.ops and "
                "fallback.min_block_size do not apply to it"
            )
        log.info("[lower] AOTInductor: compiling for %s", torch_device.describe(config.device))
        progress.doing("AOTInductor compiles the program and packages it")
        program = exported.program
        if config.device != "cpu":
            program = move_to_device_pass(program, torch_device.indexed(config.device))
            program = int4_kernels.program_for_cuda(program)
        target = self.output(config)
        path = out_dir / target.file
        with atomic_path(path) as temporary:
            aoti_compile_and_package(
                program, package_path=str(temporary), inductor_configs=_inductor_configs()
            )
        return Artifact.at(path, target, partition=None)


BACKEND = Aoti(schema=AotiConfig, runtime="aoti", delegate=None, audit=WeightsReader.aoti_package)


def _inductor_configs() -> dict[str, object]:
    """The weights go into the package as one pickled tensor per weight (data/weights/), not
    into the .so. By default Inductor copies every weight into one bytearray to build the .so's
    data section, and patches it into the object file with a slice of that bytearray (another
    copy): the lowering peaked at about three times the weights. And the loader, on the CPU,
    copies the data section (which the .so's mapping keeps resident) into a buffer of its own:
    two times at validation. Pickled weights are written one at a time from the program's own
    tensors, and loaded once, used in place (runtimes/loaders/aoti.py). Both options are
    experimental in torch; where this torch lacks them, the defaults stand."""
    from torch._inductor import config

    options: dict[str, object] = {}
    if hasattr(config.aot_inductor, "package_constants_in_so") and hasattr(
        config.aot_inductor, "package_constants_on_disk_format"
    ):
        options = {
            "aot_inductor.package_constants_in_so": False,
            "aot_inductor.package_constants_on_disk_format": "pickle_weights",
        }
    return options


def _compiler() -> str:
    """The C++ compiler Inductor will build the package with (it looks for g++, or $CXX)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except Exception as error:
        raise ConfigError(
            f"backend=aoti builds the package with a C++ compiler, and none was found ({error}); "
            "install one (Debian: apt-get install g++) or name it in the CXX environment variable."
        ) from error
