"""The exported program itself as the artifact: run by PyTorch, it checks export alone.

With `backend.device=cuda` the runtime moves it to the GPU as it loads it, so its latency can
sit next to a compiled backend's on the same device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from exporter.artifact import Artifact, Output, WeightsReader
from exporter.backends.common.declaration import Backend
from exporter.config import BackendConfig, EmbeddingQuant, FallbackConfig, QuantScheme

if TYPE_CHECKING:
    from exporter.export import Exported

log = logging.getLogger(__name__)


@dataclass
class EagerConfig(BackendConfig):
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    runtime_guards_refusal: ClassVar[str] = ""
    encode_method_refusal: ClassVar[str] = ""
    # torchao's quantized layers run as PyTorch computes them.
    quant_schemes: ClassVar[tuple[QuantScheme, ...]] = tuple(QuantScheme)
    embedding_quants: ClassVar[tuple[EmbeddingQuant, ...]] = tuple(EmbeddingQuant)

    name: str = "eager"
    atol: float = 1.0e-5
    rtol: float = 1.0e-4
    device: str = "cpu"

    def quantize_recipes(self) -> tuple[str, ...]:
        # On the CPU, PyTorch's packed int4 kernel (which holds a GGUF file's 4-bit and 8-bit
        # codes); on CUDA, torchao's weight-only layers.
        if self.device == "cpu":
            return ("int4_g128", "int4", "int8", "float")
        return ("int4_weight", "int8_weight", "float")


class Eager(Backend):
    def check(self, config: EagerConfig, fallback: FallbackConfig) -> None:
        from exporter.backends.common import torch_device

        torch_device.require(config.device)

    def output(self, config: EagerConfig) -> Output:
        from exporter.export import PROGRAM_FILE

        return Output(
            file=PROGRAM_FILE, runtime=self.runtime, audit=self.audit, device=config.device
        )

    def lower(
        self, exported: Exported, config: EagerConfig, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        # Nothing to lower and nothing to fall back from: every node runs in PyTorch, so every
        # fallback policy holds. Its toolchain is none: the artifact is the exported program,
        # whatever the device.
        log.info("[lower] eager: the exported program is the artifact")
        if not exported.path.exists():
            # A program made in memory (a part that localization cut) is saved where it says.
            import torch

            from runtimes.int4_kernels import packing_record

            record = packing_record(exported.program)
            torch.export.save(exported.program, exported.path, extra_files=record)
        return Artifact.at(exported.path, self.output(config), partition=None)


BACKEND = Eager(
    schema=EagerConfig, runtime="eager", delegate=None, audit=WeightsReader.exported_program
)
