"""A model of the user's own: a factory function, named in the config, declares it."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from exporter.config import CustomModelConfig
from exporter.errors import ConfigError
from exporter.models.bundle import ModelDeclaration


def declare(cfg: CustomModelConfig) -> ModelDeclaration:
    where, _, function_name = cfg.factory.rpartition(":")
    if not where or not function_name:
        raise ConfigError(
            f"model.factory={cfg.factory!r}: write it as package.module:function or "
            "path/to/file.py:function."
        )
    factory = getattr(_module(where, cfg.factory), function_name, None)
    if not callable(factory):
        raise ConfigError(
            f"model.factory={cfg.factory!r}: {where} has no function {function_name}."
        )
    declaration = factory(**cfg.options)
    if not isinstance(declaration, ModelDeclaration):
        raise ConfigError(
            f"model.factory={cfg.factory!r} returned {type(declaration).__name__}; "
            "it must return an exporter.models.ModelDeclaration."
        )
    return declaration


def _module(where: str, factory: str) -> object:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"model.factory={factory!r}: no such file {path}.")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as error:
        raise ConfigError(f"model.factory={factory!r}: cannot import {where}: {error}") from error


def source(cfg: CustomModelConfig) -> tuple[Path, Path]:
    """The file the factory is defined in, and the folder its imports resolve from (the file's
    own, or for package.module, the folder that holds the package)."""
    where = cfg.factory.rpartition(":")[0]
    if where.endswith(".py"):
        path = Path(where).resolve()
        return path, path.parent
    spec = importlib.util.find_spec(where)
    if spec is None or spec.origin is None:
        raise ConfigError(f"model.factory={cfg.factory!r}: cannot find the source of {where}.")
    path = Path(spec.origin)
    depth = where.count(".") + (path.name == "__init__.py")
    return path, path.parents[depth]
