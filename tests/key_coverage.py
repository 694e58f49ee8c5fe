"""`python -m tests.key_coverage OVERRIDES...`: runs a job's cached stages in this fresh process,
in an order where each key holds the one before it (model, quantize, export, lower; then
goldens, whose key holds the model's), and prints as JSON, per stage, the project's source files
that the stage imported and its cache key does not hold. Any such file could change the stage's
result without changing its key: the cache would certify a stale result.

A fresh process, so that a module counts for the first stage that imports it."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from exporter import config
from exporter.cache.fingerprint import PROJECT_ROOT
from exporter.command.schemas import register_schemas

_OURS = ("exporter", "runtimes")


def _loaded() -> set[str]:
    """The project's source files imported so far, relative to its root."""
    files = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name.partition(".")[0] in _OURS and file:
            files.add(Path(file).resolve().relative_to(PROJECT_ROOT).as_posix())
    return files


def _keyed_sources(material: Any) -> Iterator[str]:
    """Every source file a key's material holds, in its nested materials' code too."""
    if isinstance(material, dict):
        if isinstance(material.get("sources"), dict):
            yield from material["sources"]
        for value in material.values():
            yield from _keyed_sources(value)
    elif isinstance(material, list):
        for value in material:
            yield from _keyed_sources(value)


def main(overrides: list[str]) -> dict[str, list[str]]:
    register_schemas()
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), version_base="1.3"):
        job = config.to_job(compose("config", overrides))
    missing: dict[str, list[str]] = {}

    def stage(name: str, run: Any, material: Any) -> Any:
        before = _loaded()
        result = run()
        imported = _loaded() - before
        missing[name] = sorted(imported - set(_keyed_sources(material())))
        return result

    from exporter import backends, export, models
    from exporter.cache import keys
    from exporter.validate import goldens, plan, sessions

    backend = backends.configured(job)
    model_material = keys.model(job)
    bundle = stage(
        "model",
        lambda: models.build(job.model, job.dynamic, backend.llm_ops),
        lambda: model_material,
    )
    if job.quantize.enabled:
        from exporter import quantize

        bundle = stage(
            "quantize",
            lambda: quantize.quantized(bundle, job.quantize, backend.group_scales),
            lambda: model_material,
        )
    export_material = keys.export(job, model_material)
    with tempfile.TemporaryDirectory() as out:
        exported = stage(
            "export",
            lambda: export.run(bundle, job.export, Path(out)),
            lambda: export_material,
        )
        stage(
            "lower",
            lambda: backend.lower(exported, Path(out)),
            lambda: keys.lower(job, export_material),
        )
    if bundle.decoder is None:
        shapes = plan.plan(bundle.dims, [], 1, job.validate.seed)
        stage(
            "goldens",
            lambda: goldens.compute(bundle, shapes, job.validate.seed, backend.reference_device),
            lambda: keys.goldens(job, model_material, shapes),
        )
    else:
        (seq,) = bundle.dims
        planned = sessions.plan(bundle.decoder, seq, 1, job.validate.seed)
        stage(
            "goldens",
            lambda: sessions.compute(bundle, planned, 2, backend.reference_device),
            lambda: keys.goldens(job, model_material, []),
        )
    return missing


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
