"""`python -m exporter [group=option ...] [key=value ...]`: compose the job with Hydra, run it.
`python -m exporter track report=PATH` attaches a target's check to its job's MLflow run
(exporter/command/track.py).

With `-m`, Hydra runs one job per combination of the options given, through the configured
launcher (`hydra/launcher=joblib` for parallel jobs); exporter/command/sweep.py ties them together.

Only Hydra and the schemas are imported here: help, the composed config and configuration
errors answer without loading torch, which each job's worker process loads for its stages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from exporter.command import help as command_help
from exporter.command import schemas, sweep
from exporter.command import track as target_run
from exporter.config import PROJECT_ROOT
from exporter.errors import ConfigError
from exporter.job import outputs, worker
from exporter.tracking.record import JobContext

schemas.register_schemas()
outputs.register_resolver()
command_help.register_resolver()

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
        sweep_dir = Path(hydra_cfg.sweep.dir)
        # Beside its siblings, a job's run says what it varies; its folder keeps the number.
        run_name = sweep.job_run_name(sweep_dir, hydra_cfg.overrides.task) or run_dir.name
        parent_run_id = sweep.parent_run_id(sweep_dir, cfg.mlflow.tracking_uri)
    context = JobContext(run_dir, choices, run_name, parent_run_id)
    logging_config = OmegaConf.to_container(hydra_cfg.job_logging, resolve=True)
    exit_code = worker.run(cfg, context, logging_config)
    _exit_codes.append(exit_code)
    # A job that a launcher runs in a process of its own (submitit's, joblib's) returns: its
    # summary tells the sweep how it ended, and an exception there would fail the whole sweep.
    launcher_worker = hydra_cfg.mode == RunMode.MULTIRUN and not sweep.launched()
    if exit_code > 128 and not launcher_worker:
        # The job has recorded that it was stopped; a sweep's next jobs must not start.
        raise KeyboardInterrupt


def _refuse_unparsable_overrides(arguments: list[str]) -> None:
    """Exit 2 naming the override that does not parse: Hydra's own message names none
    (`validate.atol=[`: "no viable alternative at input '['")."""
    parser = OverridesParser.create()
    for argument in arguments:
        # Flags and their values (`--cfg job`) have no `=` after a leading word.
        if argument.startswith("-") or "=" not in argument:
            continue
        try:
            parser.parse_overrides([argument])
        except OverrideParseException as error:
            print(f"cannot parse the override {argument}: {error}", file=sys.stderr)
            sys.exit(ConfigError.exit_code)


def main() -> None:
    if sys.argv[1:2] == [target_run.COMMAND]:
        sys.exit(target_run.main(sys.argv[2:]))
    _refuse_unparsable_overrides(sys.argv[1:])
    try:
        run_job()
    except (ValueError, HydraException, OmegaConfBaseException) as error:
        # What Hydra raises past its own reporting: flags it cannot combine (`--cfg job -m`),
        # and a config --help cannot compose. Nothing else reaches here: a job's errors and the
        # callbacks' end in SystemExit.
        print(error, file=sys.stderr)
        if isinstance(error.__cause__, OmegaConfBaseException):
            print(error.__cause__, file=sys.stderr)
        sys.exit(ConfigError.exit_code)
    except SystemExit as exit:
        # Hydra prints a config it cannot compose (an unknown option, a bad override) and exits
        # 1 before any job starts: a configuration error.
        if exit.code not in (0, None) and not (_exit_codes or sweep.launched()):
            sys.exit(ConfigError.exit_code)
        # Hydra reported a launcher's failure mid-sweep: the sweep still gets its comparison.
        if sweep.finish_failed_launch():
            sys.exit(max(sweep.exit_codes()))
        raise
    except KeyboardInterrupt:
        sweep.finish_interrupted()
        # A stopped job's own code (130 for Ctrl-C, 143 for SIGTERM), or Ctrl-C between jobs.
        sys.exit(_exit_codes[-1] if _exit_codes and _exit_codes[-1] > 128 else 130)
    sys.exit(max(_exit_codes + sweep.exit_codes(), default=0))
