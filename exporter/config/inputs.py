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
from collections.abc import Iterable
from pathlib import Path

from exporter.config import aten_ops, hf_checkpoint
from exporter.config.backend import not_an_op
from exporter.config.hf_checkpoint import Architecture, HfTask
from exporter.config.job import JobConfig
from exporter.config.model import HfConfig, KvCache
from exporter.config.quantize import QuantScheme
from exporter.errors import ConfigError


def checked_inputs(job: JobConfig) -> JobConfig:
    """The job, once every file it names is found and is what it is said to be, and every
    package it asks for is installed; else ConfigError."""
    checkpoint = getattr(job.model, "checkpoint", None)
    if checkpoint is not None:
        architecture = _check_checkpoint(checkpoint)
        if architecture is not None and architecture.task in _ENCODED_TASKS:
            _check_encoded_job(job, checkpoint, architecture)
        elif architecture is not None and architecture.task is not HfTask.causal_lm:
            _check_non_causal_job(job, checkpoint, architecture)
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


def _check_checkpoint(checkpoint: str) -> Architecture | None:
    if not Path(checkpoint).exists():
        raise ConfigError(f"model.checkpoint={checkpoint}: no such directory or file.")
    return hf_checkpoint.check(Path(checkpoint))


# The dims of each task but a causal LM's, and the dynamic configs that bound them: an image
# classifier's are batch alone where its position embeddings fix the image's size, else the
# image's height and width too, which only the model stage can tell apart.
_TASK_DIMS = {
    HfTask.masked_lm: {"hf_encoder": {"batch", "seq"}},
    HfTask.encoder: {"hf_encoder": {"batch", "seq"}},
    HfTask.image_classification: {
        "hf_image": {"batch"},
        "hf_image_size": {"batch", "height", "width"},
    },
}


# The tasks whose decoder reads what an encode method wrote (Encoding).
_ENCODED_TASKS = (HfTask.speech_recognition, HfTask.vision_lm)


def _check_non_causal_job(job: JobConfig, checkpoint: str, architecture: Architecture) -> None:
    """A checkpoint of another task than a causal LM's is model=hf's, with its task's dims, and
    none of what a causal LM's generation takes: refused here, where the model stage would build
    a model without them and a later stage fail for want of them."""
    kind = f"{architecture.task.kind} (model_type {architecture.model_type!r})"
    choices = _TASK_DIMS[architecture.task]
    if not isinstance(job.model, HfConfig):
        raise ConfigError(
            f"model.checkpoint={checkpoint}: {kind}, and model={job.model.name} loads causal "
            f"LMs; use model=hf dynamic={next(iter(choices))} model.checkpoint={checkpoint}."
        )
    if set(job.dynamic) not in choices.values():
        dims = " or ".join(f"{_listed(names)} (dynamic={name})" for name, names in choices.items())
        raise ConfigError(
            f"dynamic: model.checkpoint={checkpoint} is {kind}, whose dims are {dims}, and "
            f"dynamic bounds {_listed(job.dynamic) or 'none'}: choose "
            f"dynamic={' or dynamic='.join(choices)}."
        )
    causal_only = (
        ("validate.prompt", job.validate.prompt is not None),
        ("model.kv_cache=static", job.model.kv_cache is KvCache.static),
        ("quantize=auto", job.quantize.scheme is QuantScheme("auto")),
        ("quantize.eval_text", job.quantize.eval_text is not None),
        ("quantize.llama_cpp", job.quantize.llama_cpp),
    )
    for setting, chosen in causal_only:
        if chosen:
            raise architecture.causal_only(setting, checkpoint)


def _check_encoded_job(job: JobConfig, checkpoint: str, architecture: Architecture) -> None:
    """A speech recognizer (Whisper) or a vision-language model (SmolVLM) is model=hf's,
    decodes with a static KV cache after its encode method reads a clip or an image, with a
    backend that lowers both methods, and takes none of what only a causal LM's text settings
    or the quantizers take yet."""
    kind = f"{architecture.task.kind} (model_type {architecture.model_type!r})"
    if not isinstance(job.model, HfConfig):
        raise ConfigError(
            f"model.checkpoint={checkpoint}: {kind}, and model={job.model.name} loads causal "
            f"LMs; use model=hf model.kv_cache=static model.checkpoint={checkpoint}."
        )
    if job.model.kv_cache is not KvCache.static:
        raise ConfigError(
            f"model.checkpoint={checkpoint} is {kind}, whose decoder runs with a static KV "
            "cache filled one token at a time: add model.kv_cache=static."
        )
    refusal = job.backend.encode_method_refusal
    if refusal:
        raise ConfigError(
            f"backend={job.backend.name}: model.checkpoint={checkpoint} is {kind}, an encode "
            f"method beside its decoder, and {refusal}; use backend=aoti or backend=eager."
        )
    unsupported = (
        ("validate.prompt", job.validate.prompt is not None),
        (f"quantize={job.quantize.scheme.value}", job.quantize.scheme is not QuantScheme.none),
        ("quantize.eval_text", job.quantize.eval_text is not None),
        ("quantize.llama_cpp", job.quantize.llama_cpp),
    )
    for setting, chosen in unsupported:
        if chosen:
            raise ConfigError(
                f"{setting}: model.checkpoint={checkpoint} is {kind}, which is exported in "
                "float only, its sessions decoding after its encode method; leave "
                f"{setting.split('=')[0]} unset."
            )


def _listed(names: Iterable[str]) -> str:
    """Names in order, as a sentence lists them: "a", "a and b", "a, b and c"."""
    ordered = sorted(names)
    return " and ".join(filter(None, [", ".join(ordered[:-1]), *ordered[-1:]]))


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
