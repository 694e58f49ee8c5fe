"""Every backend is one declaration, `BACKEND` in a module of exporter/backends/, that the rest
derives from: the registry refuses a declaration lacking a part, naming the backend and the
part, and a backend without its config option or README row fails here."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

import runtimes
from exporter import audit, backends, config
from exporter.backends.common.declaration import Backend
from exporter.backends.eager import EagerConfig
from exporter.cache.fingerprint import code_of
from exporter.config import FallbackConfig, FallbackPolicy
from exporter.export import Exported
from tests.conftest import CONF_DIR, PROJECT_ROOT
from tests.test_config import composed


def configured(*overrides: str) -> backends.ConfiguredBackend:
    return backends.configured(config.to_job(composed("model=mlp", *overrides)))


def readme_backend() -> ModuleType:
    """The README's example, as exporter/backends/mine.py would hold it."""
    section = (PROJECT_ROOT / "README.md").read_text().split("### Add a backend\n")[1]
    code = section.split("```python\n")[1].split("```")[0]
    module = ModuleType("exporter.backends.mine")
    exec(compile(code, "README.md", "exec", dont_inherit=True), module.__dict__)
    return module


def test_the_registry_is_the_modules_of_the_package_and_the_config_group() -> None:
    assert backends.names()
    assert sorted(path.stem for path in (CONF_DIR / "backend").glob("*.yaml")) == list(
        backends.names()
    )


@pytest.mark.parametrize("name", backends.names())
def test_a_backend_module_declares_every_piece(name: str) -> None:
    backend = backends.declared(name)
    schema = backend.schema
    assert backend.name == name
    # The artifact carries the declared reader and runtime to the audit and the validation.
    made = backend.output(schema())
    assert made.audit is backend.audit and made.runtime == backend.runtime


def test_the_readmes_backend_lowers_an_artifact_its_runtime_runs_and_its_reader_reads(
    tmp_path: Path,
) -> None:
    module = readme_backend()
    backend = backends.declaration_of("mine", module)
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    program = torch.export.export(linear, (x,))
    # Where the export stage saves it.
    torch.export.save(program, tmp_path / "program.pt2")
    exported = Exported(program, tmp_path / "program.pt2", ())
    policy = FallbackConfig(policy=FallbackPolicy.auto)

    artifact = backend.lower(exported, module.MineConfig(), policy, tmp_path / "lowered")

    assert (artifact.path, artifact.runtime) == (tmp_path / "program.pt2", "eager")
    (out,) = runtimes.load(artifact.path, artifact.runtime, artifact.device).run([x])
    assert torch.equal(out, linear(x).detach())
    assert len(audit.audit(artifact, dict(linear.state_dict())).checked) == 2


def _without(method: str) -> Callable[[ModuleType], None]:
    def change(module: ModuleType) -> None:
        kept = {name: f for name, f in vars(module.Mine).items() if name in ("output", "lower")}
        del kept[method]
        partial = type("Partial", (Backend,), kept)
        fields = {f.name: getattr(module.BACKEND, f.name) for f in dataclasses.fields(Backend)}
        module.BACKEND = partial(**fields)

    return change


def _replaced(**parts: object) -> Callable[[ModuleType], None]:
    def change(module: ModuleType) -> None:
        module.BACKEND = dataclasses.replace(module.BACKEND, **parts)

    return change


def _no_backend(module: ModuleType) -> None:
    del module.BACKEND


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_no_backend, "exporter.backends.mine declares no BACKEND"),
        (_replaced(schema=dict), "schema is <class 'dict'>, not a subclass of BackendConfig"),
        (_replaced(schema=EagerConfig), "schema's name defaults to 'eager', not 'mine'"),
        (_replaced(runtime="coreml"), "runtime 'coreml' is no loader of runtimes/loaders/"),
        (_replaced(delegate=3), "delegate is 3, neither a name nor None"),
        (_replaced(audit=None), "audit is None, not a reader"),
        (_without("output"), "Partial does not define output()"),
        (_without("lower"), "Partial does not define lower()"),
    ],
    ids=["BACKEND", "schema", "name", "runtime", "delegate", "audit", "output", "lower"],
)
def test_the_registry_refuses_a_declaration_lacking_a_part(
    change: Callable[[ModuleType], None], message: str
) -> None:
    module = readme_backend()
    change(module)
    with pytest.raises(backends.InvalidDeclaration) as refused:
        backends.declaration_of("mine", module)
    assert str(refused.value).startswith("backend mine: ")
    assert message in str(refused.value)


@pytest.mark.parametrize("name", backends.names())
def test_its_config_group_option_selects_its_schema_with_its_defaults(name: str) -> None:
    job = config.to_job(composed(f"backend={name}", "model=mlp"))
    schema = backends.declared(name).schema
    assert type(job.backend) is schema
    assert job.backend == schema()


@pytest.mark.parametrize("name", backends.names())
def test_its_runtime_loads_through_runtimes_load(name: str) -> None:
    runtime = __import__(f"runtimes.loaders.{backends.declared(name).runtime}", fromlist=["load"])
    assert list(inspect.signature(runtime.load).parameters) == ["path", "device"]


@pytest.mark.parametrize("name", backends.names())
def test_the_readme_lists_it_among_the_backends(name: str) -> None:
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert f"\n| `{name}` |" in readme


def test_composing_imports_no_toolchain() -> None:
    # Every backend module is imported to store its schema; none may pull torch in with it.
    code = (
        "import sys; from exporter.command import schemas; schemas.register_schemas(); "
        "heavy = {'torch', 'executorch', 'mlflow', 'transformers'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stderr


@pytest.mark.parametrize("runtime", runtimes.names())
def test_a_runtime_imports_nothing_of_the_exporter(runtime: str) -> None:
    # A target runs artifacts with the runtimes package alone.
    sources = code_of([f"runtimes.loaders.{runtime}"])["sources"]
    assert sources and all(path.startswith("runtimes/") for path in sources), sources


def test_eager_runs_on_the_kind_of_device_the_artifact_ran_on() -> None:
    assert configured("backend=eager").eager_device({}) == "cpu"
    assert configured("backend=aoti", "backend.device=cuda").eager_device({}) == "cuda"
    # A wgpu adapter on the CPU (lavapipe), or on a GPU of a machine without CUDA.
    webgpu = configured("backend=webgpu", "backend.device=gpu")
    assert webgpu.eager_device({"adapter_type": "CPU"}) == "cpu"
    gpu = "cuda" if torch.cuda.is_available() else "cpu"
    assert webgpu.eager_device({"adapter_type": "DiscreteGPU"}) == gpu


def test_the_reference_runs_where_the_artifact_rounds_as_it_does() -> None:
    assert configured("backend=eager").reference_device == "cpu"
    assert configured("backend=aoti", "backend.device=cuda").reference_device == "cuda"
    assert configured("backend=tensorrt").reference_device == "cuda"
    # A WebGPU adapter computes in float32, rounded as the CPU rounds it, even on a GPU.
    assert configured("backend=webgpu", "backend.device=gpu").reference_device == "cpu"
