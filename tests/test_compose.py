"""Every option of every config group, and every experiment with each job of its sweep, composes
into a job the command accepts: a YAML file with a bad key or value fails here, not in a user's
hands. The groups and options are read from conf/, so a new option is covered as it is added.

Accepted means what the command checks before a job starts, without torch: Hydra's compose
against the schemas, `to_job`'s values, and the places the job writes (exporter/job/outputs.py).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, open_dict, read_write

from exporter import backends
from exporter.config import JobConfig
from exporter.job import outputs
from tests.conftest import CONF_DIR

EXPERIMENT = "experiment"
GROUPS = sorted(
    path.name for path in CONF_DIR.iterdir() if path.is_dir() and path.name != EXPERIMENT
)


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


WEIGHT_ONLY = ("int4_weight", "int8_weight")


def compositions() -> dict[tuple[str, ...], list[str]]:
    """The overrides that choose each option, with the options each composition chooses.
    `dynamic` follows the model as conf/config.yaml has it: `model=mlp` chooses `dynamic=mlp`
    too; a `dynamic` option with no model of its name is a custom model's dims."""
    chosen: dict[tuple[str, ...], list[str]] = {}
    for group in GROUPS:
        for option in options(group):
            if group == "dynamic" and option in options("model"):
                overrides: tuple[str, ...] = (f"model={option}",)
            elif group == "dynamic":
                overrides = ("model=custom", f"dynamic={option}")
            elif group == "quantize" and option in WEIGHT_ONLY:
                # XNNPACK computes weight-only layers wrong: the default backend refuses them.
                overrides = (f"{group}={option}", "backend=aoti")
            else:
                overrides = (f"{group}={option}",)
            chosen.setdefault(overrides, []).append(f"{group}={option}")
    return chosen


@pytest.fixture(scope="module")
def tracking_server() -> Iterator[str]:
    """An HTTP server on 127.0.0.1: the command's check of a tracking server takes any answer."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def user_values(
    tmp_path_factory: pytest.TempPathFactory, tracking_server: str
) -> dict[str, list[str]]:
    """What an option leaves for the user to set (see its YAML), as a user gives it."""
    checkpoint = tmp_path_factory.mktemp("checkpoint")
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    return {
        "model=hf": [f"model.checkpoint={checkpoint}"],
        "model=custom": ["model.factory=tests.gelu_models:tanh_gelu_mlp"],
        "mlflow=server": [f"mlflow.tracking_uri={tracking_server}"],
    }


def composed(
    overrides: list[str], user_values: dict[str, list[str]]
) -> tuple[DictConfig, DictConfig]:
    """The job's config as Hydra hands it to the job, with the user's values for the options
    it chose (an experiment chooses some), and the `hydra` node apart."""
    cfg, hydra = hydra_compose(overrides)
    chosen = [f"{group}={option}" for group, option in hydra.runtime.choices.items()]
    given = [value for option in chosen for value in user_values.get(option, [])]
    return hydra_compose([*overrides, *given]) if given else (cfg, hydra)


def hydra_compose(overrides: list[str]) -> tuple[DictConfig, DictConfig]:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    with read_write(cfg), open_dict(cfg):
        hydra = cfg.pop("hydra")
    return cfg, hydra


def accepted(
    overrides: list[str], user_values: dict[str, list[str]]
) -> tuple[JobConfig, DictConfig]:
    cfg, hydra = composed(overrides, user_values)
    return outputs.accepted(cfg), hydra


@pytest.mark.parametrize(
    ("overrides", "options_chosen"),
    [
        pytest.param(list(overrides), chosen, id=" ".join(chosen))
        for overrides, chosen in compositions().items()
    ],
)
def test_every_option_of_every_group_composes_into_an_accepted_job(
    overrides: list[str], options_chosen: list[str], user_values: dict[str, list[str]]
) -> None:
    _, hydra = accepted(overrides, user_values)
    for option in options_chosen:
        group, _, name = option.partition("=")
        assert hydra.runtime.choices[group] == name


def sweep_jobs(params: DictConfig) -> list[list[str]]:
    """The overrides of each job of a sweep over `hydra.sweeper.params`, as Hydra's basic
    sweeper expands them: every combination of the listed values."""
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    choices = [
        [f"{o.key_or_group}={value}" for value in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [f"{o.key_or_group}={o.get_value_element_as_str()}"]
        for o in parsed
    ]
    return [list(job) for job in itertools.product(*choices)]


@pytest.mark.parametrize("experiment", options(EXPERIMENT))
def test_every_experiment_and_each_job_of_its_sweep_is_accepted(
    experiment: str, user_values: dict[str, list[str]]
) -> None:
    chosen = f"+{EXPERIMENT}={experiment}"
    _, hydra = accepted([chosen], user_values)
    assert hydra.runtime.choices[EXPERIMENT] == experiment
    params = hydra.sweeper.params
    # Each job as the sweeper launches it: its values, then the command's overrides.
    for overrides in sweep_jobs(params) if params else []:
        accepted([*overrides, chosen], user_values)
    # The file opens with a comment that says how to run it: with `-m` where it is a sweep.
    text = (CONF_DIR / EXPERIMENT / f"{experiment}.yaml").read_text().splitlines()
    header = list(itertools.takewhile(lambda line: line.startswith("#"), text))
    assert header[0] == "# @package _global_"
    (command,) = [line for line in header if "python -m exporter" in line]
    assert f"python -m exporter {'-m ' if params else ''}{chosen}" in command


@pytest.mark.parametrize("experiment", ["backend_sweep", "checkpoint_cpu_backends"])
def test_the_cpu_backend_sweeps_run_every_backend_that_runs_on_a_cpu(
    experiment: str, user_values: dict[str, list[str]]
) -> None:
    _, hydra = composed([f"+{EXPERIMENT}={experiment}"], user_values)
    swept = {override.partition("=")[2] for (override,) in sweep_jobs(hydra.sweeper.params)}
    on_a_cpu = {name for name, schema in backends.schemas().items() if "cpu" in schema.devices}
    assert swept == on_a_cpu
