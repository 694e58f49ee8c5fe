"""The artifact's latency next to eager PyTorch's at every live shape, from the job's own
benchmark stage, for a set of jobs; each job runs `--runs` times in a row to show how far its
medians move from one run to the next.

Each job is the command a user types (`python -m exporter OVERRIDES mlflow=off`) in a fresh
process; the figures are its report.json's `benchmark` section: the median over the timed runs
(ms) of the artifact and of eager (the exported program at the model's dtype, on the matching
device, with the same CPU threads), and the speedup (eager over the artifact).

    python bench/latency.py                      # this CPU: model=llama and llama_45m
    python bench/latency.py --preset gpu         # eager CUDA beside aoti (and itself)
    python bench/latency.py --job "model=llama backend=executorch dynamic.seq.max=255"

With `--runs 2` or more, `spread` is the largest difference between two runs' medians of the
artifact at that shape, over the smaller of them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

PROJECT_ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "cpu": ["model=llama backend=executorch", "model=llama_45m backend=executorch"],
    # Four KV heads, as many as query heads: torch 2.11's export (the GPU machine's) fails on
    # transformers' grouped-query attention. Eager CUDA runs beside each artifact; for WebGPU
    # there, whose lowering needs executorch 1.5 (the GPU machine has 1.2), lower here and time
    # it with bench/webgpu_latency.py.
    "gpu": [
        f"model=llama model.num_key_value_heads=4 backend={backend} backend.device=cuda"
        for backend in ("aoti", "eager")
    ],
}


def run_job(overrides: list[str], run_dir: Path, timeout: float) -> dict | str:
    """Runs one job into `run_dir`: its report's benchmark section, or why there is none."""
    command = [sys.executable, "-m", "exporter", *overrides, "mlflow=off"]
    try:
        completed = subprocess.run(
            [*command, f"hydra.run.dir={run_dir}"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    report = run_dir / "report.json"
    benchmark = json.loads(report.read_text()).get("benchmark") if report.exists() else None
    if completed.returncode != 0 or benchmark is None:
        last = completed.stderr.strip().splitlines()[-1:] or ["no output"]
        return f"exit {completed.returncode}: {last[0]}"
    return benchmark


def table(runs: list[dict]) -> str:
    """One row per shape: each run's artifact and eager medians and speedup, then the spread."""
    rows = []
    for position, first in enumerate(runs[0]["shapes"]):
        shapes = [run["shapes"][position] for run in runs]
        medians = [shape["median_ms"] for shape in shapes]
        row = [",".join(f"{k}={v}" for k, v in first["shape"].items())]
        for shape in shapes:
            eager = shape["eager"]["median_ms"] if shape["eager"] else None
            speedup = shape["speedup_vs_eager"]
            row += [
                f"{eager:.3f}" if eager else "-",
                f"{shape['median_ms']:.3f} ({shape['p10_ms']:.3f}-{shape['p90_ms']:.3f})",
                f"{speedup:.2f}x" if speedup else "-",
            ]
        if len(runs) > 1:
            row.append(f"{(max(medians) - min(medians)) / min(medians):.0%}")
        rows.append(row)
    headers = ["shape"]
    for number in range(1, len(runs) + 1):
        headers += [f"eager ms #{number}", f"artifact ms (p10-p90) #{number}", f"speedup #{number}"]
    if len(runs) > 1:
        headers.append("spread")
    return tabulate(rows, headers=headers, disable_numparse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument(
        "--job", action="append", help="one job's overrides, quoted (repeatable), for the preset's"
    )
    parser.add_argument("--runs", type=int, default=2, help="runs of each job, in a row")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for number, overrides in enumerate(args.job or PRESETS[args.preset]):
            results = [
                run_job(shlex.split(overrides), Path(folder) / f"job-{number}-{run}", args.timeout)
                for run in range(args.runs)
            ]
            print(f"\n{overrides}", flush=True)
            failed = [result for result in results if isinstance(result, str)]
            if failed:
                print(f"  no benchmark: {failed[0]}", flush=True)
                continue
            first = results[0]
            print(
                f"  {first['threads']} threads, eager on {first['eager_device']}, "
                f"artifact timed by: {first['shapes'][0]['clock']}"
            )
            print(table(results), flush=True)


if __name__ == "__main__":
    main()
