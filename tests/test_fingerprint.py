"""A fingerprint changes when a source the code imports changes, and only then; it names the
libraries that code imports with their installed versions; and it is computed without imports."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.cache import fingerprint
from exporter.cache.fingerprint import PROJECT_ROOT, code_of


def key(*args, **kwargs) -> str:
    return json.dumps(code_of(*args, **kwargs), sort_keys=True)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """pkg.a imports pkg.b lazily, pkg.b imports pkg.c relatively, pkg.d is unrelated, and
    pkg/__init__.py imports every sibling."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a, b, c, d\n")
    (pkg / "a.py").write_text("def f():\n    import pkg.b\n    return pkg.b.g()\n")
    (pkg / "b.py").write_text("from .c import VALUE\n\ndef g():\n    return VALUE\n")
    (pkg / "c.py").write_text("VALUE = 1\n")
    (pkg / "d.py").write_text("OTHER = 2\n")
    return tmp_path


def test_the_sources_are_the_module_and_what_it_imports(tree: Path) -> None:
    assert set(code_of(["pkg.a"], roots=(tree,))["sources"]) == {"pkg/a.py", "pkg/b.py", "pkg/c.py"}
    assert set(code_of(["pkg"], roots=(tree,))["sources"]) == {
        f"pkg/{name}.py" for name in ("__init__", "a", "b", "c", "d")
    }


def test_editing_an_imported_module_changes_the_key(tree: Path) -> None:
    before = key(["pkg.a"], roots=(tree,))
    (tree / "pkg" / "c.py").write_text("VALUE = 3\n")
    assert key(["pkg.a"], roots=(tree,)) != before


@pytest.mark.parametrize("edited", ["d.py", "__init__.py"])
def test_editing_a_module_not_imported_keeps_the_key(tree: Path, edited: str) -> None:
    before = key(["pkg.a"], roots=(tree,))
    with (tree / "pkg" / edited).open("a") as file:
        file.write("EDITED = True\n")
    assert key(["pkg.a"], roots=(tree,)) == before


def test_relative_imports_resolve_against_the_package(tmp_path: Path) -> None:
    (tmp_path / "top" / "sub").mkdir(parents=True)
    (tmp_path / "top" / "config.py").write_text("")
    (tmp_path / "top" / "sub" / "__init__.py").write_text("from . import leaf\n")
    (tmp_path / "top" / "sub" / "leaf.py").write_text("from ..config import *\n")
    sources = code_of(["top.sub"], roots=(tmp_path,))["sources"]
    assert set(sources) == {"top/sub/__init__.py", "top/sub/leaf.py", "top/config.py"}


def write_module(root: Path, source: str) -> None:
    (root / "m.py").write_text(source)


def test_a_library_is_listed_with_its_installed_version(tmp_path: Path) -> None:
    write_module(tmp_path, "import json\n\ndef f():\n    import torch.nn\n")
    torch_version = importlib.metadata.version("torch")
    assert torch_version.startswith("2.")
    assert code_of(["m"], roots=(tmp_path,))["libraries"] == {"torch": torch_version}


def test_a_library_is_listed_by_its_distribution_s_name_found_in_its_record(
    tmp_path: Path,
) -> None:
    # scikit-learn declares no top_level.txt: only its RECORD says that it installs sklearn.
    write_module(tmp_path, "import sklearn\n")
    assert importlib.metadata.distribution("scikit-learn").read_text("top_level.txt") is None
    assert code_of(["m"], roots=(tmp_path,))["libraries"] == {
        "scikit-learn": importlib.metadata.version("scikit-learn")
    }


def test_the_standard_library_is_not_listed(tmp_path: Path) -> None:
    write_module(tmp_path, "from __future__ import annotations\nimport json\nfrom os import path\n")
    result = code_of(["m"], roots=(tmp_path,))
    assert (set(result["sources"]), result["libraries"]) == ({"m.py"}, {})


def test_the_versions_come_from_library_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_module(tmp_path, "import torch\n")
    monkeypatch.setattr(fingerprint, "library_version", lambda name: f"{name}-9.9")
    assert code_of(["m"], roots=(tmp_path,))["libraries"] == {"torch": "torch-9.9"}


def test_a_library_not_installed_is_listed_as_such(tmp_path: Path) -> None:
    write_module(tmp_path, "from not_a_real_lib_xyz.sub import thing\n")
    assert code_of(["m"], roots=(tmp_path,))["libraries"] == {"not_a_real_lib_xyz": "not installed"}


def test_imports_only_a_type_checker_runs_are_not_followed(tree: Path) -> None:
    (tree / "pkg" / "e.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import d\nelse:\n    from pkg import c\n"
    )
    assert set(code_of(["pkg.e"], roots=(tree,))["sources"]) == {"pkg/e.py", "pkg/c.py"}


def test_the_project_s_models_list_what_they_import() -> None:
    llama = code_of(["exporter.models.llama"])
    mlp = code_of(["exporter.models.mlp"])
    assert {"transformers", "torch"} <= set(llama["libraries"])
    assert "torch" in mlp["libraries"] and "transformers" not in mlp["libraries"]
    assert {"exporter/models/mlp.py", "exporter/models/bundle.py"} <= set(mlp["sources"])
    assert "exporter/models/llama.py" not in mlp["sources"]
    assert "exporter/models/__init__.py" not in mlp["sources"]


def test_a_factory_file_s_sibling_imports_are_followed(tmp_path: Path) -> None:
    factory, helper = tmp_path.resolve() / "factory.py", tmp_path.resolve() / "helper.py"
    factory.write_text("from helper import make\n")
    helper.write_text("def make():\n    return 1\n")
    fingerprint_before = code_of([], files=[factory])
    assert set(fingerprint_before["sources"]) == {str(factory), str(helper)}
    helper.write_text("def make():\n    return 2\n")
    assert code_of([], files=[factory]) != fingerprint_before


def test_a_module_with_no_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"pkg\.missing.*" + str(tmp_path)):
        code_of(["pkg.missing"], roots=(tmp_path,))


def test_importing_it_does_not_import_torch() -> None:
    check = "import exporter.cache.fingerprint, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], cwd=PROJECT_ROOT, check=True)
