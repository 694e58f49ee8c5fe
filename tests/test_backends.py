"""Every backend is one module of exporter/backends/ whose declarations the rest derives from; a
module missing one of its pieces, or a piece without its module, fails here."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

import runtimes
from exporter import backends, config
from exporter.audit import READERS
from exporter.cache.fingerprint import code_of
from exporter.config import BackendConfig
from tests.conftest import CONF_DIR, PROJECT_ROOT
from tests.test_config import composed

FUNCTIONS = ("output", "check", "toolchain", "lower")


def test_the_registry_is_the_modules_of_the_package_and_the_config_group() -> None:
    assert backends.names() == ("aoti", "eager", "executorch", "tensorrt", "webgpu")
    assert sorted(path.stem for path in (CONF_DIR / "backend").glob("*.yaml")) == list(
        backends.names()
    )


@pytest.mark.parametrize("name", backends.names())
def test_a_backend_module_declares_every_piece(name: str) -> None:
    module = backends.declared(name)
    schema = module.SCHEMA
    assert issubclass(schema, BackendConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(schema)}
    assert defaults["name"] == name
    assert isinstance(defaults["atol"], float) and isinstance(defaults["rtol"], float)
    assert schema.devices and defaults["device"] in schema.devices
    assert module.RUNTIME in runtimes.names()
    assert module.DELEGATE is None or isinstance(module.DELEGATE, str)
    # The weights audit reads its artifact with the reader it names (no reader fails here,
    # not every job silently).
    assert module.AUDIT in READERS, f"{name} declares no weights reader the audit has"
    assert module.output(schema()).audit == module.AUDIT
    for function in FUNCTIONS:
        assert inspect.isfunction(getattr(module, function)), f"{name} has no {function}()"


@pytest.mark.parametrize("name", backends.names())
def test_its_config_group_option_selects_its_schema_with_its_defaults(name: str) -> None:
    job = config.to_job(composed(f"backend={name}", "model=mlp"))
    schema = backends.declared(name).SCHEMA
    assert type(job.backend) is schema
    assert job.backend == schema()


@pytest.mark.parametrize("name", backends.names())
def test_its_runtime_loads_through_runtimes_load(name: str) -> None:
    runtime = __import__(f"runtimes.loaders.{backends.declared(name).RUNTIME}", fromlist=["load"])
    assert list(inspect.signature(runtime.load).parameters) == ["path", "device"]


@pytest.mark.parametrize("name", backends.names())
def test_the_readme_lists_it_among_the_backends(name: str) -> None:
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert f"\n| `{name}` |" in readme


def test_composing_imports_no_toolchain() -> None:
    # Every backend module is imported to store its schema; none may pull torch in with it.
    code = (
        "import sys; from exporter.config import store; store.register_schemas(); "
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
