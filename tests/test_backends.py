"""Every backend is one module of exporter/backends/ whose declarations the rest derives from; a
module missing one of its pieces, or a piece without its module, fails here."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

import runtimes
from exporter import backends, config
from exporter.cache.fingerprint import code_of
from tests.conftest import CONF_DIR, PROJECT_ROOT
from tests.test_config import composed


def configured(*overrides: str) -> backends.ConfiguredBackend:
    return backends.configured(config.to_job(composed("model=mlp", *overrides)))


def test_the_registry_is_the_modules_of_the_package_and_the_config_group() -> None:
    assert backends.names() == ("aoti", "eager", "executorch", "tensorrt", "webgpu")
    assert sorted(path.stem for path in (CONF_DIR / "backend").glob("*.yaml")) == list(
        backends.names()
    )


@pytest.mark.parametrize("name", backends.names())
def test_a_backend_module_declares_every_piece(name: str) -> None:
    backend = backends.declared(name)
    schema = backend.schema
    assert backend.name == name
    assert backend.runtime in runtimes.names()
    # The artifact carries the declared reader and runtime to the audit and the validation.
    made = backend.output(schema())
    assert made.audit is backend.audit and made.runtime == backend.runtime
    assert made.device in schema.devices or made.device == "cuda"


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
