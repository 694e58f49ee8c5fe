"""How much memory a whole job takes, stage by stage, against the size of the model's weights.

Each config runs as one job through the command a user types (`python -m exporter CONFIG
mlflow=off cache=off`), in a fresh process, so every stage does its work. The numbers come from
the job's summary.json: per stage (model, export, goldens, lower, validate, benchmark) its wall
seconds and the peak resident set (RSS) of the job's worker process during it, then the job's
peak, the weights' size (parameters and buffers, each storage once) and the job's peak over the
weights.

    python bench/memory.py
    python bench/memory.py --config "model=llama_1b backend=executorch"

A stage's cell reads `seconds / peak GB` (GB = 10^9 bytes). RSS is host memory: with
backend.device=cuda the GPU's own memory is not in it. A stage's peak is its own on Linux; where
the summary's peak_rss_scope is "process" (no per-stage reset) it is the job's peak so far, and
the table marks the job with `*`. The peak includes torch's own footprint (about 0.7 GB with
executorch loaded), so small models have large ratios. `exit` is the job's exit code: 1 (the
artifact failed validation) still ran every stage, so its figures stand. Jobs write into a
temporary folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf
from tabulate import tabulate

PROJECT_ROOT = Path(__file__).resolve().parents[1]

STAGES = ("model", "export", "goldens", "lower", "validate", "benchmark")
GB = 1e9

# A mid-size Llama (about 50 M parameters, 0.2 GB in float32): a job takes about a minute on a
# 2-core machine, and the weights outweigh nothing but torch's own footprint.
LLAMA = (
    "model=llama model.hidden_size=512 model.num_hidden_layers=4 model.num_attention_heads=8 "
    "model.num_key_value_heads=4 model.intermediate_size=1376 model.vocab_size=32000"
)
DEFAULT_CONFIGS = [
    f"{LLAMA} model.dtype={dtype} backend={backend}"
    for dtype in ("float32", "bfloat16")
    for backend in ("eager", "executorch")
]


def run_job(overrides: list[str], run_dir: Path, timeout: float) -> str:
    """Runs one job into `run_dir`; its exit code, or "timeout"."""
    command = [
        sys.executable,
        "-m",
        "exporter",
        *overrides,
        "mlflow=off",
        "cache=off",
        f"hydra.run.dir={run_dir}",
    ]
    try:
        completed = subprocess.run(
            command, cwd=PROJECT_ROOT, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    return str(completed.returncode)


def row(run_dir: Path, overrides: str, exit_code: str) -> list[str]:
    """The job's table row, from its summary and resolved config in `run_dir`; a job refused
    before it wrote them is named by its overrides."""
    if not (run_dir / "config.yaml").exists():
        return [overrides, *["-"] * (len(STAGES) + 5), exit_code]
    config = OmegaConf.load(run_dir / "config.yaml")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    seconds = summary.get("seconds", {})
    peaks = summary.get("peak_rss_bytes", {})
    stage_cells = [
        f"{seconds[stage]:.1f} / {peaks[stage] / GB:.2f}" if stage in peaks else "-"
        for stage in STAGES
    ]
    weights = summary.get("weight_bytes")
    job_peak = summary.get("job_peak_rss_bytes")
    ratio = summary.get("peak_rss_over_weights")
    scope = "" if summary.get("peak_rss_scope") == "stage" else "*"
    return [
        f"{config.model.name}{scope}",
        config.model.dtype,
        config.backend.name,
        f"{weights / GB:.3f}" if weights else "-",
        *stage_cells,
        f"{job_peak / GB:.2f}" if job_peak else "-",
        f"{ratio:.1f}" if ratio else "-",
        exit_code,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        action="append",
        help="one job's overrides, quoted (repeatable); default: a mid-size llama in float32 "
        "and bfloat16 through eager and executorch",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for number, overrides in enumerate(args.config or DEFAULT_CONFIGS):
            run_dir = Path(folder) / f"run-{number}"
            exit_code = run_job(shlex.split(overrides), run_dir, args.timeout)
            rows.append(row(run_dir, overrides, exit_code))
            print(f"{overrides}: exit {exit_code}", file=sys.stderr, flush=True)
    headers = [
        "model",
        "dtype",
        "backend",
        "weight GB",
        *(f"{stage} s / GB" for stage in STAGES),
        "job peak GB",
        "peak / weights",
        "exit",
    ]
    print(tabulate(rows, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
