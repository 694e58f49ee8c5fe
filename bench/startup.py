"""How long the command takes to answer when it has nothing to compute: help, the composed
config, and configuration errors. Each command runs several times in a fresh process, as a user
types it; the table gives the median, fastest and slowest wall time and the exit code.

    python bench/startup.py --repeats 5

Jobs write into a temporary folder (run dir, MLflow store, cache), never into outputs/.
A command that runs past `--timeout` seconds is stopped and shown as such.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# (what the user asks, the overrides); every one is answered without exporting anything.
COMMANDS: list[tuple[str, list[str]]] = [
    ("help", ["--help"]),
    ("composed config", ["--cfg", "job"]),
    ("unknown key", ["+foo=1"]),
    ("misspelt key", ["+validat.atol=1"]),
    ("unknown backend", ["backend=tflite"]),
    ("wrong type", ["dynamic.seq.min=abc"]),
    ("min > max", ["dynamic.seq.min=300"]),
    ("negative tolerance", ["validate.atol=-1"]),
    ("no such checkpoint", ["model.checkpoint=/no/such/dir"]),
    ("model=hf without a checkpoint", ["model=hf"]),
    ("checkpoint without config.json", ["model=hf", "model.checkpoint={workdir}/empty"]),
    ("config.json not JSON", ["model=hf", "model.checkpoint={workdir}/broken"]),
    ("run dir not writable", ["model=mlp", "hydra.run.dir={workdir}/file/run"]),
    ("unknown ATen op", ["model=mlp", "fallback.ops=[aten.nonzeroo.default]"]),
    ("cuda without a GPU", ["model=mlp", "backend=eager", "backend.device=cuda"]),
    ("unreachable MLflow server", ["model=mlp", "mlflow.tracking_uri=http://127.0.0.1:9"]),
]


def timed(overrides: list[str], workdir: Path, timeout: float) -> tuple[float, str]:
    """Wall seconds of one `python -m exporter ...` and its exit code (or "timeout")."""
    overrides = [override.format(workdir=workdir) for override in overrides]
    command = [sys.executable, "-m", "exporter", *overrides]
    if not overrides[0].startswith("--"):
        command += [
            *(
                []
                if any(o.startswith("hydra.run.dir=") for o in overrides)
                else [f"hydra.run.dir={workdir}/run"]
            ),
            f"cache_dir={workdir}/cache",
            *(
                []
                if any(o.startswith("mlflow.tracking_uri=") for o in overrides)
                else [f"mlflow.tracking_uri=sqlite:///{workdir}/mlflow.db"]
            ),
            f"mlflow.artifact_location={workdir}/mlartifacts",
        ]
    start = time.perf_counter()
    try:
        completed = subprocess.run(
            command, cwd=PROJECT_ROOT, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, "timeout"
    return time.perf_counter() - start, str(completed.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        # Checkpoints that are not: an empty folder, a config.json that is not JSON; a file
        # where the run dir's folder should be.
        (workdir / "empty").mkdir()
        (workdir / "broken").mkdir()
        (workdir / "broken" / "config.json").write_text('{"model_type": "llama",')
        (workdir / "file").write_text("")
        # The store's tables are made once, before anything is timed.
        timed(["validate.atol=-1"], workdir, args.timeout)
        for what, overrides in COMMANDS:
            runs = [timed(overrides, workdir, args.timeout) for _ in range(args.repeats)]
            seconds = [wall for wall, _ in runs]
            codes = sorted({code for _, code in runs})
            rows.append(
                [
                    what,
                    " ".join(overrides),
                    f"{statistics.median(seconds):.2f}",
                    f"{min(seconds):.2f}",
                    f"{max(seconds):.2f}",
                    ",".join(codes),
                ]
            )
            print(f"{what}: {rows[-1][2]} s", file=sys.stderr, flush=True)
    headers = ["asks", "python -m exporter ...", "median s", "min s", "max s", "exit"]
    print(tabulate(rows, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
