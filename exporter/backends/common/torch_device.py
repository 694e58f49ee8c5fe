"""The PyTorch device a backend's artifact runs on must exist here, or the job stops before any
work."""

from __future__ import annotations

import ctypes

from exporter.errors import ConfigError


def require(device: str) -> None:
    """For the backends that run in PyTorch: backend.device=cuda needs a CUDA device. Without
    NVIDIA's driver there is none, which is known without loading torch (seconds)."""
    if device != "cuda":
        return
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise ConfigError(
            "backend.device=cuda, but this machine has no NVIDIA driver (libcuda.so.1 cannot "
            "be loaded), so no CUDA device; allowed here: backend.device=cpu."
        ) from None
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "backend.device=cuda, but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
            "allowed here: backend.device=cpu."
        )


def describe(device: str) -> str:
    """The device as a cache key and a log line should name it: cpu, or cuda (its GPU's name)."""
    if device == "cuda":
        import torch

        return f"cuda ({torch.cuda.get_device_name()})"
    return device


def indexed(device: str) -> str:
    """The device with its index, as a program is moved to it: constants that name "cuda:0"
    (a Llama's rotary tables) must compare equal to it, or Inductor refuses them."""
    if device == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return device
