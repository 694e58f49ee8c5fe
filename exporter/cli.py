"""`python -m exporter [group=option ...] [key=value ...]`: compose the job with Hydra, run it.

With `-m`, Hydra runs one job per combination of the options given, through the configured
launcher (`hydra/launcher=joblib` for parallel jobs); exporter.sweep ties them together.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from exporter import config, pipeline, sweep
from exporter.config import PROJECT_ROOT
from exporter.errors import ConfigError

config.register_schemas()

# Exit codes of the jobs run in this process; Hydra drops a job's return value.
_exit_codes: list[int] = []


# An absolute path: from a module other than __main__, Hydra would look for a `conf` package.
@hydra.main(version_base="1.3", config_path=str(PROJECT_ROOT / "conf"), config_name="config")
def run_job(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    choices = dict(hydra_cfg.runtime.choices)
    run_name, parent_run_id = f"{choices['model']}-{choices['backend']}", None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        run_name = run_dir.name
        parent_run_id = sweep.parent_run_id(Path(hydra_cfg.sweep.dir), cfg.mlflow.tracking_uri)
    exit_code = pipeline.run(cfg, run_dir, choices, run_name, parent_run_id)
    _exit_codes.append(exit_code)
    if exit_code == 130:
        # The job has recorded its interruption; Ctrl-C must still stop a sweep's next jobs.
        raise KeyboardInterrupt


def main() -> None:
    try:
        run_job()
    except SystemExit as exit:
        # Hydra prints a config it cannot compose (an unknown option, a bad override) and exits
        # 1 before any job starts: a configuration error.
        if exit.code not in (0, None) and not (_exit_codes or sweep.launched()):
            sys.exit(ConfigError.exit_code)
        raise
    except KeyboardInterrupt:
        sweep.finish_interrupted()
        sys.exit(130)
    sys.exit(max(_exit_codes + sweep.exit_codes(), default=0))
