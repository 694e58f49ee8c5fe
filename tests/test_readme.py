"""The README as a newcomer reads it: short enough to read, its cheap commands run as written
and print what it shows, its workstation commands use the project's venv, CI runs its test
command, and its links lead to a file and a heading that exist.

A command the README shows with its output is written in a fenced block as `$ COMMAND`,
optionally ending in `# exit N` (0 otherwise), followed by the lines it prints; `...` stands
for lines left out. Every such command must be cheap: this test runs them all.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
DOCS = PROJECT_ROOT / "docs"
MAX_LINES = 400
VENV_PYTHON = ".venv/bin/python"
ELIDED = "..."
_EXIT_COMMENT = re.compile(r"#\s*exit\s+(\d+)\s*$")
_TIMESTAMP = re.compile(r"^\[\d\d:\d\d:\d\d\]")
# Commands a user runs on the workstation, which must come from the venv there; the target's
# check and runner (`python -m runtimes.check`, `python -m runtimes.run`) run on the target's
# own Python.
_WORKSTATION_PROGRAMS = ("python", "python3", "pip", "mlflow", "pytest", "ruff")
_ALLOWED_BARE = ("python3 -m venv", "python -m runtimes.check", "python -m runtimes.run")
# `EXPORTER_REQUIRE_SLURM=1 .venv/bin/python ...`: the program comes after the environment.
_ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class ShownCommand:
    command: str
    exit_code: int
    output: tuple[str, ...]


def code_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced block, in order."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def shown_commands(text: str) -> list[ShownCommand]:
    shown: list[ShownCommand] = []
    for block in code_blocks(text):
        command, output = None, []
        for line in [*block, "$ "]:
            if line.startswith("$ "):
                if command:
                    exit_code = _EXIT_COMMENT.search(command)
                    shown.append(
                        ShownCommand(
                            command, int(exit_code.group(1)) if exit_code else 0, tuple(output)
                        )
                    )
                command, output = line[2:].strip(), []
            elif command is not None:
                output.append(line)
    return shown


def prints(output: list[str], shown: tuple[str, ...]) -> bool:
    """Whether `output` begins with `shown`'s lines, where `...` stands for any lines."""
    position, anchored = 0, True
    for line in shown:
        if line == ELIDED:
            anchored = False
            continue
        if anchored:
            if position >= len(output) or output[position] != line:
                return False
            position += 1
        else:
            if line not in output[position:]:
                return False
            position = output.index(line, position) + 1
            anchored = True
    return True


def normalized(line: str) -> str:
    return _TIMESTAMP.sub("[HH:MM:SS]", line.rstrip())


def readme() -> str:
    return README.read_text()


def run_as_written(command: ShownCommand, run_dir: Path) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command.command, comments=True)
    assert argv[0] == VENV_PYTHON, f"{command.command}: start it with {VENV_PYTHON}"
    # The interpreter running this test is the venv's; a job's files go under the test's own
    # folder, not the project's outputs/.
    return subprocess.run(
        [sys.executable, *argv[1:], f"hydra.run.dir={run_dir}"],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )


def test_the_readme_is_at_most_400_lines() -> None:
    assert len(readme().splitlines()) <= MAX_LINES


def test_the_readme_shows_help_the_composed_job_and_a_bad_key() -> None:
    shown = shown_commands(readme())
    commands = [command.command for command in shown]
    assert any(" --help" in command for command in commands), commands
    assert any(" --cfg job" in command for command in commands), commands
    assert any(command.exit_code == 2 for command in shown), commands


@pytest.mark.parametrize("shown", shown_commands(readme()), ids=lambda shown: shown.command)
def test_each_command_the_readme_shows_prints_what_it_shows(
    shown: ShownCommand, tmp_path: Path
) -> None:
    completed = run_as_written(shown, tmp_path / "run")
    assert completed.returncode == shown.exit_code, completed.stdout
    assert "Traceback" not in completed.stdout
    output = [normalized(line) for line in completed.stdout.splitlines()]
    expected = tuple(normalized(line) for line in shown.output)
    assert prints(output, expected), (
        f"{shown.command} printed:\n{completed.stdout}\nwhere the README shows:\n"
        + "\n".join(shown.output)
    )


def test_workstation_commands_use_the_venv() -> None:
    bare = []
    for block in code_blocks(readme()):
        # In a block that shows commands with their output, only the `$ ` lines are commands.
        shows_output = any(line.startswith("$ ") for line in block)
        continued = False
        for line in block:
            # A line after a trailing backslash holds arguments, not a command.
            if not continued and (line.startswith("$ ") or not shows_output):
                command_line = line.removeprefix("$ ")
                for command in re.split(r"&&|;|\|", command_line.split(" #")[0]):
                    words = command.split()
                    while words and _ENV_ASSIGNMENT.fullmatch(words[0]):
                        words.pop(0)
                    if (
                        words
                        and words[0] in _WORKSTATION_PROGRAMS
                        and not " ".join(words).startswith(_ALLOWED_BARE)
                    ):
                        bare.append(line)
            continued = line.rstrip().endswith("\\")
    assert not bare, bare


def test_ci_runs_the_readmes_test_command() -> None:
    test_commands = [
        line
        for block in code_blocks(readme())
        for line in block
        if line.startswith("apt-get") and "pytest" in line
    ]
    assert len(test_commands) == 1, test_commands
    ci = (PROJECT_ROOT / ".ci" / "run").read_text().splitlines()
    assert test_commands[0] in ci


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda page: page.name)
def test_every_link_to_a_project_file_leads_to_it_and_its_heading(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and anchor not in heading_anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"
