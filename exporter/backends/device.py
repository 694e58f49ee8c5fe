"""The device a backend's artifact runs on must exist here, or the job stops before any work."""

from __future__ import annotations

import torch

from exporter.config import Device
from exporter.errors import ConfigError


def require(device: Device) -> None:
    """For the backends that run in PyTorch, on one of its devices."""
    if device in (Device.gpu, Device.auto):
        raise ConfigError(
            f"backend.device={device.value} picks a wgpu adapter, which only backend=webgpu "
            "does; allowed here: backend.device=cpu or cuda."
        )
    if device is Device.cuda and not torch.cuda.is_available():
        raise ConfigError(
            "backend.device=cuda, but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
            "allowed here: backend.device=cpu."
        )


def describe(device: Device) -> str:
    """The device as a cache key and a log line should name it: cpu, or cuda (its GPU's name)."""
    if device is Device.cuda:
        return f"cuda ({torch.cuda.get_device_name()})"
    return device.value


def indexed(device: Device) -> str:
    """The device with its index, as a program is moved to it: constants that name "cuda:0"
    (a Llama's rotary tables) must compare equal to it, or Inductor refuses them."""
    if device is Device.cuda:
        return f"cuda:{torch.cuda.current_device()}"
    return device.value
