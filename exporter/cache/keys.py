"""What determines each cached result: the material its cache key is hashed from.

Besides the config, a key holds the code that computes the result and the versions of the
libraries that code imports (exporter/cache/fingerprint.py): after an edit of the model's file, an
upgrade of transformers or an edit of the lowering code, the key changes and the work is done
again; nothing stale is certified. Settings that do not change a result stay out of its key:
tolerances and the device an artifact runs on re-use the lowered artifact.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from exporter import backends, models
from exporter.cache.fingerprint import PROJECT_ROOT, code_of
from exporter.config import (
    BackendConfig,
    CausalLmConfig,
    CustomModelConfig,
    JobConfig,
    KvCache,
    ModelConfig,
)
from exporter.models import custom
from runtimes import int4_kernels
from runtimes.verdict.shapes import LiveShape


def model(job: JobConfig) -> dict[str, Any]:
    """What determines the module the model stage builds, and the quantize stage after it."""
    quantize = {}
    if job.quantize.enabled:
        quantize = {
            "config": dataclasses.asdict(job.quantize),
            "group_scales": backends.configured(job).group_scales,
            # What quantize=auto plans with, and the text it measures on: the plan, and so the
            # model, depends on both.
            "recipes": list(job.backend.quantize_recipes()),
            # int4_weight's layers: PyTorch's int4 kernel's, or torchao's.
            "int4_weight_packed": job.backend.int4_weight_packed,
            # The codes as the CPU's int4 kernel packs them, which differs between CPUs (a cache
            # shared by machines of two packings must not hand one the other's weights).
            "cpu_packing": repr(int4_kernels.CPU_PACKING),
            "eval_text": _digest(job.quantize.eval_text),
            "code": code_of(["exporter.quantize"]),
        }
    material = {
        "config": dataclasses.asdict(job.model),
        "code": model_code(job.model),
        "quantize": quantize,
        # A checkpoint rewritten in place is another model; its size and time say so without
        # reading gigabytes.
        "checkpoint": {
            str(path): [path.stat().st_size, path.stat().st_mtime_ns]
            for path in checkpoint_files(job.model)
        },
    }
    if isinstance(job.model, CausalLmConfig) and job.model.kv_cache is KvCache.static:
        # The backend picks the ops of the cache the model stage builds.
        material["llm_ops"] = backends.configured(job).llm_ops.value
    return material


def model_code(cfg: ModelConfig) -> dict[str, Any]:
    """The sources and library versions behind the module the model stage builds: the stage,
    the model's builder and what they import, or a custom factory's file and what it imports."""
    modules = [models.__name__, models.builder(cfg)]
    if isinstance(cfg, CustomModelConfig):
        file, root = custom.source(cfg)
        return code_of(modules, files=[file], roots=(PROJECT_ROOT, root))
    return code_of(modules)


def checkpoint_files(cfg: ModelConfig) -> list[Path]:
    """The files of the checkpoint the model is read from, if any: one rewritten in place makes
    another model."""
    checkpoint = getattr(cfg, "checkpoint", None)
    if not checkpoint:
        return []
    if Path(checkpoint).is_file():  # a GGUF file named itself
        return [Path(checkpoint)]
    return sorted(path for path in Path(checkpoint).rglob("*") if path.is_file())


def _digest(path: str | None) -> str | None:
    return None if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()


def plan(job: JobConfig, model_material: dict[str, Any]) -> dict[str, Any]:
    """What determines quantize=auto's plan: the model with its quantize settings (recipes and
    text included), and the seed of the random token rows a model without a tokenizer is
    measured on."""
    return {"model": model_material, "seed": job.validate.seed}


def export(job: JobConfig, model_material: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model_material,
        "dynamic": {name: [b.min, b.max, b.mode.value] for name, b in sorted(job.dynamic.items())},
        "on_failure": job.export.on_failure.value,
        "guards": job.export.guards.value,
        "code": code_of(["exporter.export"]),
    }


def goldens(
    job: JobConfig, model_material: dict[str, Any], shapes: list[LiveShape]
) -> dict[str, Any]:
    return {
        "model": model_material,
        "shapes": shapes,
        "seed": job.validate.seed,
        "greedy_tokens": job.validate.greedy_tokens,
        "prompt": job.validate.prompt,
        "reference_device": backends.configured(job).reference_device,
        "code": code_of(
            [
                "exporter.validate.goldens",
                "exporter.validate.sessions",
                "exporter.quantize.quality",
                "exporter.quantize.verdict",
            ]
        ),
    }


def lower(job: JobConfig, export_material: dict[str, Any]) -> dict[str, Any]:
    """The exported program's material, the backend's own settings and toolchain, the fallback
    policy's partitioning, and the backend's lowering code."""
    return {
        "export": export_material,
        "backend": job.backend.name,
        "settings": _lowering_settings(job.backend),
        "toolchain": backends.configured(job).toolchain(),
        "fallback": job.fallback.partitioning(),
        "code": code_of([f"exporter.backends.{job.backend.name}"]),
    }


def _lowering_settings(backend: BackendConfig) -> dict[str, Any]:
    """The fields a backend's schema adds to BackendConfig's: those shape its artifact. The
    common ones do not: the tolerances are validation's, the device the runtime's (a backend
    whose artifact depends on the device, as a compiled package does, names it in its
    toolchain)."""
    common = {field.name for field in dataclasses.fields(BackendConfig)}
    return {key: value for key, value in dataclasses.asdict(backend).items() if key not in common}
