"""AOTInductor: torch._inductor compiles the exported program, its dynamic dims kept, into a .pt2
package of native code (C++ on the CPU, Triton kernels on CUDA) that `aoti_load_package` runs.

Inductor compiles every op of the program, data-dependent ones included (nonzero's count becomes
a runtime size), so nothing is partitioned and nothing falls back.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from torch._inductor import aoti_compile_and_package
from torch._inductor.cpp_builder import get_cpp_compiler
from torch.export.passes import move_to_device_pass

from exporter.backends import device
from exporter.backends.artifact import Artifact, Output
from exporter.config import BackendConfig, Device, FallbackConfig
from exporter.errors import ConfigError
from exporter.export import Exported
from exporter.files import atomic_path

log = logging.getLogger(__name__)

DELEGATE = None


def check(backend: BackendConfig, fallback: FallbackConfig) -> None:
    device.require(backend.device)
    _compiler()


def output(backend: BackendConfig) -> Output:
    return Output(file="model.pt2", format="aoti_package", device=backend.device)


def toolchain(backend: BackendConfig) -> dict[str, str]:
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    return {"device": device.describe(backend.device), "compiler": version[0] if version else ""}


def lower(
    exported: Exported, backend: BackendConfig, fallback: FallbackConfig, out_dir: Path
) -> Artifact:
    if fallback.ops or fallback.min_block_size > 1:
        log.warning(
            "[lower] backend=aoti compiles every op into the package; fallback.ops and "
            "fallback.min_block_size do not apply to it"
        )
    log.info("[lower] AOTInductor: compiling for %s", device.describe(backend.device))
    program = exported.program
    if backend.device is not Device.cpu:
        program = move_to_device_pass(program, device.indexed(backend.device))
    target = output(backend)
    path = out_dir / target.file
    with atomic_path(path) as temporary:
        aoti_compile_and_package(program, package_path=str(temporary))
    return Artifact.at(path, target, partition=None)


def _compiler() -> str:
    """The C++ compiler Inductor will build the package with (it looks for g++, or $CXX)."""
    try:
        return get_cpp_compiler()
    except Exception as error:
        raise ConfigError(
            f"backend=aoti builds the package with a C++ compiler, and none was found ({error}); "
            "install one (Debian: apt-get install g++) or name it in the CXX environment variable."
        ) from error
