"""From the config Hydra composed to the typed job: its keys checked against the schema, its
values built into the schema's dataclasses (whose checks run as they are built), then the files
and packages it names checked (exporter/config/inputs.py); and the config flattened into
MLflow's params."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from exporter.config.inputs import checked_inputs
from exporter.config.job import JobConfig
from exporter.config.tracking import MlflowConfig
from exporter.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Anchors the run dirs and the embedded MLflow store at the project, whatever the cwd.
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)

# How alike (difflib's ratio) a key must be to a declared one to be named as the key meant: a
# letter or two off in a word of four or more passes (`validat.atol`: 0.96, `atl` for `atol`:
# 0.86); `foo` for `floor` (0.75) does not.
_NEAR = 0.8
# A last part that many keys share (`seed`, `min`) names a few of them, not every one.
_MOST_SUGGESTED = 3

# What a key that a config group leaves for the user to set takes.
_MISSING_VALUES = {
    "model.checkpoint": (
        "DIR, a Hugging Face checkpoint directory written by save_pretrained(), or FILE.gguf"
    ),
}


def to_job(cfg: DictConfig) -> JobConfig:
    """The composed config as typed objects; raises ConfigError for keys and values the schema
    rejects, and for files and packages the job names that are not there or not what it
    takes."""
    _check_keys(cfg)
    try:
        job: Any = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as error:
        key = error.full_key
        raise ConfigError(
            f"{key} is not set; give it on the command line: "
            f"{key}={_MISSING_VALUES.get(key, 'VALUE')}."
        ) from None
    except OmegaConfBaseException as error:
        raise ConfigError(str(error)) from error
    return checked_inputs(job)


def _check_keys(cfg: DictConfig) -> None:
    """Raises ConfigError naming every key no schema declares, with the nearest valid key.

    Hydra lets `+key=value` add a key anywhere, and converting to the typed schema drops what
    it does not know: a typo such as `+validat.atol=1` would be ignored without a word."""
    known: list[str] = []
    unknown: list[str] = []

    def walk(node: DictConfig, prefix: str, inside_unknown: bool) -> None:
        schema = OmegaConf.get_type(node)
        declared = {f.name for f in fields(schema)} if is_dataclass(schema) else None
        for key, value in node.items_ex(resolve=False):
            path = f"{prefix}{key}"
            stray = inside_unknown or (declared is not None and key not in declared)
            if isinstance(value, DictConfig) and len(value):
                walk(value, f"{path}.", stray)
            else:
                (unknown if stray else known).append(path)

    walk(cfg, "", inside_unknown=False)
    if unknown:
        named = "; ".join(f"+{key}{_nearest(key, known)}" for key in unknown)
        raise ConfigError(
            f"unknown key {named}. The job's schema has no such key; `python -m exporter "
            "--cfg job` prints every key it has."
        )


def _nearest(key: str, known: list[str]) -> str:
    """` (nearest valid key: K)` for a key that looks like a misspelling of K: the whole dotted
    key near one declared, or else its last part near the last part of declared ones (`+atol=1`
    names backend.atol and validate.atol); nothing for a key near none."""
    close = get_close_matches(key, known, n=1, cutoff=_NEAR)
    if not close:
        leaves = {k: k.rpartition(".")[2] for k in known}
        near_leaves = get_close_matches(
            key.rpartition(".")[2], set(leaves.values()), n=1, cutoff=_NEAR
        )
        close = sorted(k for k, leaf in leaves.items() if leaf in near_leaves)[:_MOST_SUGGESTED]
    if not close:
        return ""
    return f" (nearest valid key{'s' if len(close) > 1 else ''}: {', '.join(close)})"


def mlflow_of(cfg: DictConfig) -> MlflowConfig:
    """The job's MLflow settings alone, typed: usable when a value elsewhere is wrong."""
    try:
        mlflow: Any = OmegaConf.to_object(cfg.mlflow)
    except OmegaConfBaseException as error:
        raise ConfigError(str(error)) from error
    return mlflow


def flatten(cfg: DictConfig) -> dict[str, str]:
    """`{"model.hidden_size": "64", ...}`: the resolved config as MLflow params."""
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix.rstrip(".")] = str(node)

    try:
        container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except OmegaConfBaseException:
        # A config rejected for a value that does not resolve still gets its params, as written.
        container = OmegaConf.to_container(cfg, enum_to_str=True)
    walk(container, "")
    return flat
