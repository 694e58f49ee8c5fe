"""Which GPU runs the program: a wgpu adapter picked by `backend.device` (auto, gpu or cpu)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import wgpu

# Discrete first: under `auto` the fastest GPU wins; a software GPU (lavapipe) comes last.
_PREFERENCE = ("DiscreteGPU", "IntegratedGPU", "VirtualGPU", "CPU")
_instance_ready = False


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    backend: str  # Vulkan, Metal, D3D12
    kind: str  # DiscreteGPU, IntegratedGPU, VirtualGPU, CPU


class NoAdapter(RuntimeError):
    pass


def _adapters() -> list[wgpu.GPUAdapter]:
    global _instance_ready
    if not _instance_ready:
        # Vulkan's window-system layers complain on stderr without a runtime dir, though compute
        # needs no window: give them a private one.
        if not os.environ.get("XDG_RUNTIME_DIR"):
            os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="wgpu-runtime-")
        from wgpu.backends.wgpu_native.extras import set_instance_extras

        # wgpu's GL backend offers lavapipe a second time, with fewer compute features.
        set_instance_extras(backends=["Vulkan", "Metal", "DX12"])
        _instance_ready = True
    return list(wgpu.gpu.enumerate_adapters_sync())


def info(adapter: wgpu.GPUAdapter) -> AdapterInfo:
    details = adapter.info
    return AdapterInfo(
        name=details["device"], backend=details["backend_type"], kind=details["adapter_type"]
    )


def available() -> list[AdapterInfo]:
    return [info(a) for a in _adapters()]


def choose(device: str) -> wgpu.GPUAdapter:
    """`auto`: the first adapter by _PREFERENCE; `gpu`: a hardware GPU, never a software one;
    `cpu`: a software GPU on the CPU (Mesa's lavapipe)."""
    adapters = _adapters()
    listed = ", ".join(f"{info(a).name} ({info(a).kind}, {info(a).backend})" for a in adapters)
    if device == "cpu":
        candidates = [a for a in adapters if info(a).kind == "CPU"]
    elif device == "gpu":
        candidates = [a for a in adapters if info(a).kind != "CPU"]
    elif device == "auto":
        candidates = adapters
    else:
        raise ValueError(f"device {device!r} is not a wgpu adapter choice; allowed: auto, gpu, cpu")
    if not candidates:
        raise NoAdapter(
            f"wgpu finds no adapter for device={device} (it sees: {listed or 'none'}). "
            + (
                "On a machine without a GPU, Mesa's lavapipe is one: "
                "apt-get install mesa-vulkan-drivers."
                if device != "gpu"
                else "cpu picks lavapipe, a software GPU; a hardware GPU needs its Vulkan driver."
            )
        )
    return min(candidates, key=lambda a: _PREFERENCE.index(info(a).kind))
