"""`python -m runtimes.check BUNDLE [--device DEVICE] [--report PATH]`: validate a job's artifact
on a target that has only its bundle (runtimes/formats/bundle.py), torch, the artifact's runtime
package and this package.

It runs the bundle's plan as the job's validate stage does (runtimes/verdict/; a model with a KV
cache: its sessions on one loaded instance, runtimes/verdict/sessions.py), prints a line per
execution (judged step) and the same table, and writes the same report.json, with a `check`
section that says where it ran and which run the bundle came from; `python -m exporter track
report=PATH` attaches that report to the run. What native libraries print (ExecuTorch's C++ log
lines) goes to native.log beside the report, not to the terminal. It imports nothing of the
exporter, the model's libraries, Hydra or MLflow.

Exit codes: 0 every live shape (judged step) passed, 1 one failed, 2 the bundle is incomplete
or a file does not match its checksum (the message names the file), or the report cannot be
written where asked, 5 the artifact cannot be loaded or run, 130 stopped by Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from runtimes import Loaded, load, native_log, packages
from runtimes.files import atomic_path
from runtimes.formats.bundle import Bundle, BundleInvalid, read, versions
from runtimes.verdict import judging, sessions
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.goldens import Goldens
from runtimes.verdict.report import Execution, Report, execution_line, json_safe
from runtimes.verdict.shapes import LiveShape

PASSED, FAILED, BAD_BUNDLE, RUNTIME_FAILED, STOPPED = 0, 1, 2, 5, 130
REPORT_FILE = "report.json"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    folder = Path(args.bundle)
    try:
        bundle = read(folder)
        goldens = bundle.goldens()
    except BundleInvalid as error:
        print(f"[check] the bundle cannot be checked: {error}", file=sys.stderr)
        return BAD_BUNDLE
    device = args.device or bundle.device
    report_path = Path(args.report) if args.report else folder / REPORT_FILE
    print(f"[check] bundle {folder} ({bundle.total_bytes / 1e6:.1f} MB), {_source(bundle)}")
    print(
        f"[check] {bundle.artifact} on runtime {bundle.runtime}, device {device}; {_plan(bundle)}, "
        f"{bundle.tolerances.describe()}"
    )
    kind = device.split(":")[0]
    if kind in ("cpu", "cuda") and kind != goldens.reference_device:
        # The same dtype rounds differently on a GPU; the rule still scales the job's figure.
        print(
            f"[check] eager's error at the model's dtype, which the rule scales, was measured "
            f"on {goldens.reference_device}; this check runs on {device}"
        )
    started = time.time()

    def load_artifact() -> Loaded:
        try:
            return load(bundle.artifact_path, bundle.runtime, device)
        except Exception as error:
            raise _LoadFailed(bundle.load_failure(device, error)) from error

    def after_each(number: int, execution: Execution) -> None:
        print(f"[check] {execution_line(number, len(bundle.executions), execution)}", flush=True)

    native = report_path.parent / native_log.NATIVE_LOG
    # A folder the report cannot go to is said when the report is written.
    writable = report_path.parent.is_dir() and os.access(report_path.parent, os.W_OK)
    try:
        with native_log.routed_to(native) if writable else contextlib.nullcontext():
            report = _run(bundle, goldens, load_artifact, after_each)
    except KeyboardInterrupt:
        print("[check] stopped by Ctrl-C; no report written", file=sys.stderr)
        return STOPPED
    except (_LoadFailed, ArtifactFailed) as error:
        print(f"[check] {error}", file=sys.stderr)
        payload = _check(bundle, device, started, RUNTIME_FAILED, str(error))
        return _written(report_path, payload) or RUNTIME_FAILED
    code = PASSED if report.passed else FAILED
    per = "session" if report.sessions else "live shape"
    print(f"[check] verdict per {per}:\n{report.table()}")
    if ran_on := report.ran_on():
        print(f"[check] ran on {ran_on}")
    if report.generation:
        print(f"[check] {report.generation.line()}")
    if report.passed:
        judged = "judged steps" if report.sessions else "live shapes"
        print(f"[check] passed at all {len(report.shapes)} {judged}")
    else:
        print(f"[check] FAILED: {report.failure_message()}")
    return _written(report_path, _check(bundle, device, started, code, None, report)) or code


def _plan(bundle: Bundle) -> str:
    """What the check runs: `7 live shapes, 13 executions`, or for a model with a KV cache `3
    sessions (prefills 1, 9, 16; 25 steps), 18 judged`."""
    if not bundle.sessions:
        return f"{len(bundle.shapes)} live shapes, {len(bundle.executions)} executions"
    prefills = ", ".join(str(s["prefill"]) for s in bundle.sessions)
    steps = sum(s["steps"] for s in bundle.sessions)
    return (
        f"{len(bundle.sessions)} sessions (prefills {prefills}; {steps} steps), "
        f"{len(bundle.shapes)} judged"
    )


def _run(
    bundle: Bundle,
    goldens: Goldens,
    load_artifact: Callable[[], Loaded],
    after_each: Callable[[int, Execution], None],
) -> Report:
    """The bundle's plan run and judged: its executions, or its goldens' sessions in order on
    one instance."""
    if not goldens.sessions:
        return judging.run(
            bundle.output_names,
            load_artifact,
            bundle.shapes,
            bundle.executions,
            goldens,
            bundle.tolerances,
            after_each,
        )

    def judged(outputs: Sequence[torch.Tensor], shape: LiveShape) -> tuple:
        return judging.judge(bundle.output_names, outputs, shape, goldens, bundle.tolerances)

    return sessions.run(
        bundle.output_names, load_artifact, goldens, bundle.tolerances, judged, after_each
    )


class _LoadFailed(Exception):
    """The artifact's runtime could not load it on the device."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtimes.check",
        description="Validate an artifact on this machine against the goldens of its bundle.",
    )
    parser.add_argument("bundle", help="the bundle folder (a job's run dir has it as bundle/)")
    parser.add_argument(
        "--device",
        help="where the artifact runs (cpu, cuda, cuda:1; a wgpu adapter choice auto, gpu or "
        "cpu for webgpu); default: the job's",
    )
    parser.add_argument("--report", help="where to write report.json; default: in the bundle")
    return parser


def _source(bundle: Bundle) -> str:
    source = bundle.source
    run = f"MLflow run {source['run_id']}" if source.get("run_id") else "no MLflow run"
    return f"from {source.get('host', 'an unknown host')}, {run}"


def _check(
    bundle: Bundle,
    device: str,
    started: float,
    exit_code: int,
    error: str | None,
    report: Report | None = None,
) -> dict[str, Any]:
    """report.json: the report as the job writes it, or where the artifact did not run, only
    that it did not pass; and the `check` section."""
    payload = report.to_json() if report else {"passed": False}
    payload["check"] = {
        "bundle": str(bundle.folder.resolve()),
        "source": dict(bundle.source),
        "runtime": bundle.runtime,
        "device": device,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "packages": _installed(bundle.runtime),
        "started": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "seconds": time.time() - started,
        "exit_code": exit_code,
        "error": error,
    }
    return payload


def _installed(runtime: str) -> dict[str, str]:
    """The installed versions of torch and of the distributions the runtime's loader declares;
    torch's alone where there is no such loader or it cannot be imported (the load's error says
    why)."""
    try:
        declared = packages(runtime)
    except (ImportError, ValueError):
        declared = ()
    return versions(("torch", *declared))


def _written(path: Path, payload: Mapping[str, Any]) -> int | None:
    """Writes the report atomically (a reader sees the old one or the whole new one); None once
    written, else the exit code of a place the report cannot go, said on stderr."""
    try:
        with atomic_path(path) as temporary:
            temporary.write_text(json.dumps(json_safe(payload), indent=2) + "\n")
    except OSError as error:
        print(
            f"[check] cannot write the report to {path}: {error}; give it another place with "
            "--report PATH",
            file=sys.stderr,
        )
        return BAD_BUNDLE
    print(f"[check] report written to {path}")
    return None


if __name__ == "__main__":
    sys.exit(main())
