"""The mlflow group's schema (`mlflow=`): the MLflow store a job's run is tracked in."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from exporter.errors import ConfigError


@dataclass
class MlflowConfig:
    """`artifact_location`: where a new experiment keeps its files; empty lets the store decide
    (a tracking server's --artifacts-destination)."""

    enabled: bool = MISSING
    tracking_uri: str = ""
    artifact_location: str = ""
    experiment: str = "exporter"

    def __post_init__(self) -> None:
        if self.enabled and not self.tracking_uri:
            raise ConfigError(
                "mlflow.tracking_uri is not set; give the store to log to, e.g. "
                "mlflow.tracking_uri=http://HOST:5000 for mlflow=server, or use mlflow=local "
                "(a SQLite file under outputs/) or mlflow=off."
            )
