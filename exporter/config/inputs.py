"""The files and installed packages a job names, checked before torch is loaded: a wrong path,
a checkpoint transformers would refuse or that would run code, an ATen op torch does not
declare, or a missing llama-cpp-python fails at compose, in a line, rather than seconds into the
job.

Checked here, once the schema is built (`to_job`), rather than by the schemas: OmegaConf builds
those whenever it converts a config, and code builds them directly, so building one reads no
file. A checkpoint of a schema built without `to_job` is still checked, by the model stage
(exporter/models/hf.py), once torch is loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from exporter.config import aten_ops, hf_checkpoint
from exporter.config.backend import not_an_op
from exporter.config.job import JobConfig
from exporter.errors import ConfigError


def checked_inputs(job: JobConfig) -> JobConfig:
    """The job, once every file it names is found and is what it is said to be, and every
    package it asks for is installed; else ConfigError."""
    checkpoint = getattr(job.model, "checkpoint", None)
    if checkpoint is not None:
        _check_checkpoint(checkpoint)
    for op in job.fallback.ops:
        _check_declared(op)
    eval_text = job.quantize.eval_text
    if eval_text is not None and not Path(eval_text).is_file():
        raise ConfigError(
            f"quantize.eval_text={eval_text}: no such file (a UTF-8 text that quality "
            "is measured on)."
        )
    if job.quantize.llama_cpp:
        _check_llama_cpp(checkpoint)
    if job.artifact is not None and not Path(job.artifact).is_file():
        raise ConfigError(f"artifact={job.artifact}: no such file.")
    return job


def _check_checkpoint(checkpoint: str) -> None:
    if not Path(checkpoint).exists():
        raise ConfigError(f"model.checkpoint={checkpoint}: no such directory or file.")
    hf_checkpoint.check(Path(checkpoint))


def _check_declared(op: str) -> None:
    """An ATen name of `fallback.ops` against torch's declarations. Other namespaces
    (ExecuTorch's dim_order_ops) exist only once their backend is imported, so only their form
    is checked (FallbackConfig)."""
    namespace, _, name_and_overload = op.partition(".")
    declared = aten_ops.declared() if namespace == "aten" else None
    if declared is not None and name_and_overload not in declared:
        raise not_an_op(op)


def _check_llama_cpp(checkpoint: str) -> None:
    """quantize.llama_cpp runs the GGUF file a quantized model was read from (JobConfig makes
    sure there is a checkpoint), with llama-cpp-python."""
    if hf_checkpoint.gguf_file(Path(checkpoint)) is None:
        raise ConfigError(
            f"quantize.llama_cpp: model.checkpoint={checkpoint} is no GGUF file, which "
            "llama.cpp runs."
        )
    if importlib.util.find_spec("llama_cpp") is None:
        raise ConfigError(
            "quantize.llama_cpp: llama.cpp's Python binding is not installed: pip install "
            "llama-cpp-python (it builds llama.cpp for this machine)."
        )
