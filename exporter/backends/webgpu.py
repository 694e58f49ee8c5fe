"""WebGPU: ExecuTorch's WebGPU partitioner (its Vulkan partitioner in the WebGPU configuration)
-> a .pte whose delegates are VulkanBackend payloads, run by runtimes/webgpu through wgpu.

ExecuTorch is imported by `lower` only: a target that validates a .pte built elsewhere
(`artifact=`) needs torch and wgpu, not the toolchain that lowered it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from exporter.backends.artifact import Artifact, Output
from exporter.config import BackendConfig, Device, FallbackConfig
from exporter.errors import ConfigError
from exporter.export import Exported

DELEGATE = "VulkanBackend"
_DEVICES = (Device.auto, Device.gpu, Device.cpu)


def check(backend: BackendConfig, fallback: FallbackConfig) -> None:
    if backend.device not in _DEVICES:
        raise ConfigError(
            f"backend=webgpu picks a wgpu adapter, not backend.device={backend.device.value}; "
            "allowed: backend.device=auto, gpu or cpu."
        )
    try:
        from runtimes.webgpu import adapter
    except ImportError as error:
        raise ConfigError(
            f"backend=webgpu runs on wgpu, which cannot be imported here ({error}): "
            "pip install wgpu"
        ) from error
    try:
        adapter.choose(backend.device.value)
    except adapter.NoAdapter as error:
        # A machine without the GPU asked for is the user's news, not a bug: no traceback.
        raise ConfigError(
            f"backend=webgpu backend.device={backend.device.value}: {error}"
        ) from None


def output(backend: BackendConfig) -> Output:
    return Output(file="model.pte", format="webgpu_pte", device=backend.device)


def toolchain(backend: BackendConfig) -> dict[str, str]:
    # The lowering is the same whichever adapter will run it.
    return {"executorch": importlib.metadata.version("executorch")}


def lower(
    exported: Exported, backend: BackendConfig, fallback: FallbackConfig, out_dir: Path
) -> Artifact:
    from exporter.backends.executorch import announced_policy, lowered_to_pte
    from exporter.backends.webgpu_partitioner import PolicyPartitioner

    partitioner = PolicyPartitioner(announced_policy("WebGPU", fallback, exported))
    return lowered_to_pte(exported, partitioner, partitioner.why_on_cpu, output(backend), out_dir)
