"""WebGPU: ExecuTorch's WebGPU partitioner (its Vulkan partitioner in the WebGPU configuration)
-> a .pte whose delegates are VulkanBackend payloads, run by runtimes/webgpu through wgpu on any
GPU wgpu reaches (Vulkan, Metal, D3D12), or on Mesa's lavapipe, a software GPU.

ExecuTorch is imported by `lower` only: a target that validates a .pte built elsewhere
(`artifact=`) needs torch, wgpu and flatbuffers, not the toolchain that lowered it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from exporter.artifact import Artifact, Output, WeightsReader
from exporter.backends.common.declaration import Backend
from exporter.config import BackendConfig, FallbackConfig, ModelDtype
from exporter.errors import ConfigError

if TYPE_CHECKING:
    from exporter.export import Exported


@dataclass
class WebgpuConfig(BackendConfig):
    """`device` picks the wgpu adapter: auto (a discrete GPU first, lavapipe last), gpu
    (hardware only) or cpu (lavapipe: apt-get install mesa-vulkan-drivers)."""

    devices: ClassVar[tuple[str, ...]] = ("auto", "gpu", "cpu")
    # The runtime's WGSL kernels compute in f32.
    dtypes: ClassVar[tuple[ModelDtype, ...]] = (ModelDtype.float32,)
    # ExecuTorch's edge dialect refuses the symbolic arithmetic that computes the asserts, which
    # its decomposition puts back however often they are removed.
    runtime_guards_refusal: ClassVar[str] = (
        "ExecuTorch's edge dialect refuses the arithmetic that computes them"
    )
    quant_refusal: ClassVar[str] = (
        "Its WGSL kernels are float32 ones, with none for torchao's quantize and dequantize "
        "ops or an integer matrix product."
    )

    name: str = "webgpu"
    atol: float = 1.0e-4
    rtol: float = 1.0e-3
    device: str = "auto"


# The rewrites of exporter/backends/common/xnnpack_rewrites.py that keep more of a transformers
# model on the GPU: the causal mask built from positions, attention as bmm and softmax (SDPA's
# decomposition and the boolean mask stay on the CPU otherwise) and rotate_half as a linear.
# Not the expands (their cats of 5-D tensors stay on the CPU) nor the means (no 4-D mean here).
WEBGPU_REWRITES = ("attention", "rotations", "aliases")


class Webgpu(Backend):
    def check(self, config: WebgpuConfig, fallback: FallbackConfig) -> None:
        try:
            from runtimes.loaders.webgpu import adapter
        except ImportError as error:
            raise ConfigError(
                f"backend=webgpu runs on wgpu, which cannot be imported here ({error}): "
                "pip install wgpu"
            ) from error
        try:
            adapter.choose(config.device)
        except adapter.NoAdapter as error:
            # A machine without the GPU asked for is the user's news, not a bug: no traceback.
            raise ConfigError(f"backend=webgpu backend.device={config.device}: {error}") from None

    def output(self, config: WebgpuConfig) -> Output:
        return Output(
            file="model.pte", runtime=self.runtime, audit=self.audit, device=config.device
        )

    def lower(
        self, exported: Exported, config: WebgpuConfig, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        # The lowering is the same whichever adapter will run it (no toolchain), and
        # ExecuTorch's version is among the libraries its lowering code imports.
        from exporter.backends.common.executorch_program import announced_policy, lowered_to_pte
        from exporter.backends.common.xnnpack_rewrites import rewritten
        from exporter.backends.webgpu.dynamic_dims import kept_dynamic
        from exporter.backends.webgpu.partitioner import PolicyPartitioner

        partitioner = PolicyPartitioner(announced_policy("WebGPU", fallback, exported))
        program = rewritten(exported.program, WEBGPU_REWRITES)
        with kept_dynamic(exported):
            return lowered_to_pte(
                replace(exported, program=program),
                partitioner,
                partitioner.why_on_cpu,
                self.output(config),
                out_dir,
            )

    def reference_device(self, config: WebgpuConfig) -> str:
        # A WebGPU adapter computes in float32 only, where the CPU's rounding is the model's.
        return "cpu"

    def eager_device(self, config: WebgpuConfig, target: Mapping[str, str]) -> str:
        # `device` is a wgpu adapter choice, not torch's: eager runs on CUDA where the adapter
        # was a GPU of a machine that has CUDA, else on the CPU.
        import torch

        on_gpu = target.get("adapter_type", "CPU") != "CPU"
        return "cuda" if on_gpu and torch.cuda.is_available() else "cpu"


BACKEND = Webgpu(
    schema=WebgpuConfig, runtime="webgpu", delegate="VulkanBackend", audit=WeightsReader.pte
)
