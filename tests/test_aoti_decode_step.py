"""backend.decode_step: an AOTInductor package of a KV-cache model with its one-token call compiled
apart as a second model (exporter/backends/aoti.py), which the loader runs for every decode step,
over the same weights and cache as the model. Its default compiles it on CUDA only; here
`backend.decode_step=true` makes it on the CPU, through the same packaging, loader and verdict."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from exporter import config
from exporter.backends import aoti
from runtimes.loaders.aoti import DECODE_STEP, MODEL, _load, calls
from tests.conftest import composed, job_in_process
from tests.test_kv_backends import assert_sessions_passed
from tests.test_kv_cache import SMALL

ONE_TOKEN = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


@pytest.fixture(scope="module")
def stepped_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("aoti-decode-step")
    record, report = job_in_process(run_dir, "backend=aoti", "backend.decode_step=true", *SMALL)
    assert record.error is None
    return run_dir, report


@pytest.mark.parametrize(
    ("overrides", "compiled"),
    [
        ((), False),
        (("backend.device=cuda",), True),
        (("backend.device=cuda", "backend.decode_step=false"), False),
        (("backend.decode_step=true",), True),
    ],
)
def test_the_decode_step_is_compiled_where_it_pays_unless_the_config_says(
    overrides: tuple[str, ...], compiled: bool
) -> None:
    backend = config.to_job(composed("backend=aoti", *overrides)).backend
    assert aoti.compiles_decode_step(backend) is compiled


@pytest.mark.slow
def test_the_package_holds_the_decode_step_over_one_copy_of_the_weights(
    stepped_job: tuple[Path, dict],
) -> None:
    with zipfile.ZipFile(stepped_job[0] / "model.pt2") as archive:
        names = archive.namelist()
        configs = {
            name.split("/")[-2]: json.loads(archive.read(name))
            for name in names
            if name.endswith("weights_config.json")
        }
    assert set(configs) == {MODEL, DECODE_STEP}
    # Every weight and cache buffer the decode step reads is the model's file, as its view.
    assert configs[DECODE_STEP].keys() == configs[MODEL].keys()
    assert all(configs[DECODE_STEP][name] == entry for name, entry in configs[MODEL].items())
    stored = [name for name in names if "/data/weights/" in name]
    assert len(stored) == len({entry[0] for entry in configs[MODEL].values()})
    # The audit reads each once.
    audit = stepped_job[1]["weights_audit"]
    assert audit["read"].startswith(f"{len(configs[MODEL])} pickled package weights")
    assert audit["passed"] and audit["checked"] > 0 and not audit["mismatched"]


@pytest.mark.slow
def test_every_decode_step_passes_and_runs_the_decode_step(
    stepped_job: tuple[Path, dict],
) -> None:
    run_dir, report = stepped_job
    assert_sessions_passed(report)
    ran: list[str] = []
    models = {
        name: _Counted(runner, name, ran)
        for name, runner in _load(run_dir / "model.pt2", single_threaded=False).items()
    }
    call = calls(models)
    tokens = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    call(tokens[:, :8], torch.arange(8))
    first = call(tokens[:, 8:9], torch.tensor([8]))
    second = call(tokens[:, 9:], torch.tensor([9]))
    assert ran == [MODEL, DECODE_STEP, DECODE_STEP]
    with torch.no_grad():
        whole = torch.export.load(run_dir / "program.pt2").module()(tokens, torch.arange(10))
    torch.testing.assert_close(first[0, -1], whole[0, 8], atol=1e-5, rtol=0)
    torch.testing.assert_close(second[0, -1], whole[0, 9], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_decode_step_over_its_own_cache_fails_the_decode_steps_after_a_prefill(
    stepped_job: tuple[Path, dict], tmp_path: Path
) -> None:
    # The fault the shared tensors prevent: a decode step compiled from a second load of the
    # program has its own weights and cache, which the model's prefills never write.
    program_file = stepped_job[0] / "program.pt2"
    own = aoti.decode_step_program(torch.export.load(program_file), ONE_TOKEN)
    faulty = tmp_path / "model.pt2"
    aoti.package(torch.export.load(program_file), faulty, own)
    record, report = job_in_process(tmp_path / "run", "backend=aoti", *SMALL, f"artifact={faulty}")
    assert record.error is not None
    steps = [(e["shape"], e["passed"]) for e in report["executions"]]
    prefilled = {s["session"] for s, _ in steps if s["pos"] == 0 and s["seq"] > 1}
    after_prefill = [passed for s, passed in steps if s["session"] in prefilled and s["pos"] > 0]
    # The prefills run the model and pass; a one-token session runs the decode step alone,
    # over its own cache throughout, and passes too.
    assert after_prefill and not any(after_prefill)
    assert all(passed for s, passed in steps if s["pos"] == 0)
    assert all(passed for s, passed in steps if s["session"] not in prefilled)


class _Counted:
    """A package's model that records its name in `ran` at each call."""

    def __init__(self, runner: Callable[..., object], name: str, ran: list[str]) -> None:
        self._runner, self._name, self._ran = runner, name, ran

    def get_metadata(self) -> dict[str, str]:
        return self._runner.get_metadata()

    def __call__(self, *inputs: torch.Tensor) -> object:
        self._ran.append(self._name)
        return self._runner(*inputs)
