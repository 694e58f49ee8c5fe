"""How long the whole default job takes, as a user runs it, next to another tool's command
(a peer exporter, such as optimum-executorch's CLI). The two commands run alternately, each in
a fresh process, so that the machine's load falls on both alike; the table gives each run's
wall time, each command's median, and the ratio of the medians (ours / peer).

    python bench/job_time.py --peer "optimum-cli export executorch --model DIR \\
        --task text-generation --recipe xnnpack --max_seq_len 256 --output_dir OUT"
    python bench/job_time.py --peer "..." --ours "model=llama cache=off" --runs 5

Our command is `python -m exporter OVERRIDES` with this interpreter (default overrides:
`cache=off dynamic.seq.max=255`, the largest sequence the peer's `--max_seq_len 256` takes),
writing its run dirs and its MLflow store (SQLite, tables made before anything is timed) into
a temporary folder, never into outputs/. The peer's command is a shell string, run as given:
it writes where it says. A command that runs past `--timeout` seconds is stopped and shown as
such; a non-zero exit code is shown next to its time.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from tabulate import tabulate

PROJECT_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OVERRIDES = "cache=off dynamic.seq.max=255"


def timed(command: list[str] | str, timeout: float) -> tuple[float, str]:
    """Wall seconds of one command, a fresh process, and its exit code (or "timeout"); a string
    runs through the shell."""
    start = time.perf_counter()
    try:
        completed = subprocess.run(
            command,
            cwd=PROJECT_ROOT,
            shell=isinstance(command, str),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, "timeout"
    return time.perf_counter() - start, str(completed.returncode)


def cell(run: tuple[float, str]) -> str:
    seconds, code = run
    return f"{seconds:.1f}" if code == "0" else f"{seconds:.1f} (exit {code})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True, help="the peer's command, a shell string")
    parser.add_argument(
        "--ours", default=DEFAULT_OVERRIDES, help="overrides of python -m exporter, quoted"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each command")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = parser.parse_args()
    ours_runs: list[tuple[float, str]] = []
    peer_runs: list[tuple[float, str]] = []
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        store_uri = f"sqlite:///{workdir}/mlflow.db"
        # Opening a new SQLite store makes its tables, seconds that a user's store has behind it.
        MlflowClient(tracking_uri=store_uri).search_experiments()
        for number in range(args.runs):
            ours = [
                sys.executable,
                "-m",
                "exporter",
                *shlex.split(args.ours),
                f"hydra.run.dir={workdir}/run-{number}",
                f"mlflow.tracking_uri={store_uri}",
                f"mlflow.artifact_location={workdir}/mlartifacts",
            ]
            ours_runs.append(timed(ours, args.timeout))
            peer_runs.append(timed(args.peer, args.timeout))
            print(
                f"run {number + 1}: ours {cell(ours_runs[-1])} s, peer {cell(peer_runs[-1])} s",
                file=sys.stderr,
                flush=True,
            )
    rows = [
        [number + 1, cell(o), cell(p)]
        for number, (o, p) in enumerate(zip(ours_runs, peer_runs, strict=True))
    ]
    ours_median = statistics.median(seconds for seconds, _ in ours_runs)
    peer_median = statistics.median(seconds for seconds, _ in peer_runs)
    rows.append(["median", f"{ours_median:.1f}", f"{peer_median:.1f}"])
    rows.append(["ours / peer", f"{ours_median / peer_median:.2f}", ""])
    print(f"ours: python -m exporter {args.ours}\npeer: {args.peer}")
    print(tabulate(rows, headers=["run", "ours s", "peer s"], disable_numparse=True))


if __name__ == "__main__":
    main()
