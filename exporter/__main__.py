"""`python -m exporter [group=option ...] [key=value ...]`: compose the job with Hydra, run it."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from exporter import pipeline
from exporter.errors import ConfigError

# Jobs this process started, and the exit codes of those that ended; Hydra drops return values.
_jobs_started: list[str] = []
_exit_codes: list[int] = []


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _job(cfg: DictConfig) -> None:
    runtime = HydraConfig.get().runtime
    _jobs_started.append(runtime.output_dir)
    _exit_codes.append(pipeline.run(cfg, Path(runtime.output_dir), dict(runtime.choices)))


def main() -> None:
    try:
        _job()
    except SystemExit as exit:
        # Hydra prints a config it cannot compose (an unknown option, a bad override) and exits
        # 1 before any job starts: a configuration error.
        if exit.code not in (0, None) and not _jobs_started:
            sys.exit(ConfigError.exit_code)
        raise
    sys.exit(max(_exit_codes, default=0))


if __name__ == "__main__":
    main()
