"""The default suite's order across xdist workers: the long files that tests/conftest.py hands
out first exist under their names, and xdist keeps that order rather than its own."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.conftest import LONGEST_FILES, PROJECT_ROOT


def test_the_files_handed_out_first_exist_and_xdist_keeps_their_order() -> None:
    tests = Path(__file__).parent
    assert [name for name in LONGEST_FILES if not (tests / name).is_file()] == []
    pytest_options = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "--no-loadscope-reorder" in pytest_options["ini_options"]["addopts"].split()
