"""Where eager PyTorch runs at the model's dtype to measure the error the reference rule scales:
the device kind of the artifact's target, since the same dtype rounds differently on a GPU."""

from __future__ import annotations

from exporter.config import JobConfig


def reference_device(job: JobConfig) -> str:
    """cuda for an artifact that runs on CUDA; the CPU for every other target (a WebGPU adapter
    computes in float32 only, where the CPU's rounding is the model's)."""
    return "cuda" if job.backend.device == "cuda" else "cpu"
