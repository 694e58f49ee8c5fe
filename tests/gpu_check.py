"""The project's GPU check: every backend and device pair that runs on a CUDA machine, run as a
user runs it, since CI has no GPU and a CUDA path can break unseen.

    python tests/gpu_check.py    # the tiny llama: eager and aoti on cuda, float32 and bfloat16,
                                 # without a KV cache and with a static one; and int4_weight
                                 # and auto quantized through aoti in bfloat16
    python tests/gpu_check.py --models llama,llama_1b --webgpu-bundle PATH/bundle

Each case is one job (`python -m exporter ... backend.device=cuda mlflow=off`): it must exit 0,
pass at every live shape, pass the weights audit with weights checked, and benchmark beside
eager (with `model.kv_cache=static`, its sessions must also reach the cache's last slot; where
its and eager's greedy tokens part from the float64 oracle's is shown, and its slowest decode
step over the floor of reading the artifact's bytes at the card's peak memory bandwidth); then
the target's check (`python -m runtimes.check`) replays its bundle on cuda and must pass too.
`--webgpu-bundle` replays a WebGPU bundle built on a CPU machine (ExecuTorch's WebGPU lowering
needs the CPU machine's torch) on this machine's Vulkan GPU (`--device gpu`). The table it
prints, and gpu_check.json in `--out`, are what a closing note quotes. Exit 0 when every case
passed, 1 otherwise, 2 where this machine has no CUDA device.

The GPU machine's torch 2.11 does not export transformers' grouped-query attention (a guard in
its SDPA integration), so the Llamas run with as many KV heads as heads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
HEADS = {"llama": 4, "llama_45m": 8, "llama_1b": 32}


@dataclass
class Case:
    model: str
    backend: str
    dtype: str
    kv_cache: str = "none"
    quantize: str = "none"
    device: str = "cuda"
    # What was seen: the job's exit code, its report's verdict and worst ratio, the audit's
    # counts, the benchmark's speedup range, where the artifact's and eager's greedy tokens
    # part from the oracle's (KV cache only), the bundle check's exit code, and seconds.
    job_exit: int | None = None
    passed_shapes: str = ""
    worst_ratio: float | None = None
    worst_max_abs: float | None = None
    audit: str = ""
    speedup: str = ""
    # A KV-cache case: its slowest decode step over the floor of reading the artifact's bytes
    # at the card's peak memory bandwidth, and that floor.
    floor: str = ""
    greedy: str = ""
    check_exit: int | None = None
    target: str = ""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        cache = "" if self.kv_cache == "none" else f"-kv_{self.kv_cache}"
        quantized = "" if self.quantize == "none" else f"-{self.quantize}"
        return f"{self.model}{cache}{quantized}-{self.backend}-{self.device}-{self.dtype}"

    @property
    def passed(self) -> bool:
        return not self.problems


def run_job(case: Case, work: Path) -> None:
    run_dir = work / "runs" / case.name
    command = [
        sys.executable,
        "-m",
        "exporter",
        f"model={case.model}",
        f"model.dtype={case.dtype}",
        f"model.num_key_value_heads={HEADS[case.model]}",
        f"model.kv_cache={case.kv_cache}",
        f"quantize={case.quantize}",
        # Random weights: what quantization costs them says nothing (a 1B model's int4 weights
        # cost a KLD of 0.19 on its nearly flat predictions); the check judges fidelity.
        *(["quantize.budget.max_kld=inf"] if case.quantize != "none" else []),
        f"backend={case.backend}",
        f"backend.device={case.device}",
        "mlflow=off",
        f"cache_dir={work / 'cache'}",
        f"hydra.run.dir={run_dir}",
    ]
    start = time.perf_counter()
    job = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    case.job_exit = job.returncode
    (work / f"{case.name}.log").write_text(job.stdout + job.stderr)
    if job.returncode != 0:
        case.problems.append(f"job exit {job.returncode}: {_last_error(job.stdout + job.stderr)}")
    read_results(case, run_dir)
    if (run_dir / "bundle" / "manifest.json").exists():
        check_bundle(case, run_dir / "bundle", case.device, work)
    else:
        case.problems.append("no bundle written")
    case.seconds = time.perf_counter() - start


def read_results(case: Case, run_dir: Path) -> None:
    report_path = run_dir / "report.json"
    if not report_path.exists():
        case.problems.append("no report.json")
        return
    report = json.loads(report_path.read_text())
    shapes = report["shapes"]
    case.passed_shapes = f"{sum(s['passed'] for s in shapes)}/{len(shapes)}"
    case.worst_ratio = max(s["ratio"] for s in shapes)
    case.worst_max_abs = max(s["max_abs"] for s in shapes)
    if not report["passed"]:
        case.problems.append(f"validation failed at {case.passed_shapes} shapes passed")
    if case.kv_cache != "none":
        read_sessions(case, report)
    found = report.get("weights_audit")
    if found is None:
        case.problems.append("no weights audit")
    else:
        case.audit = f"{found['checked']} checked, {len(found['mismatched'])} mismatched"
        if not found["passed"] or found["checked"] == 0:
            case.problems.append(f"weights audit: {case.audit}")
    summary = json.loads((run_dir / "summary.json").read_text())
    speedups = [s for s in summary["speedup_vs_eager"] if s is not None]
    if speedups:
        case.speedup = f"{min(speedups):.2f}x..{max(speedups):.2f}x"
    elif summary.get("worst_speedup_vs_eager") is not None:
        # A KV-cache job times prefill and decode calls, not live shapes.
        case.speedup = (
            f"worst {summary['worst_speedup_vs_eager']:.2f}x; decode "
            f"{summary['decode_tokens_per_s']:.0f} tokens/s at the last slot"
        )
    else:
        case.problems.append("no benchmark beside eager")
    if case.kv_cache != "none":
        floor = report.get("benchmark", {}).get("floor")
        if floor is None:
            case.problems.append("no memory floor for the decode steps")
        else:
            worst = summary["worst_decode_floor_ratio"]
            case.floor = f"{worst:.2f}x of {floor['ms']:.3g} ms"
    case.target = summary["target"].get("cuda_device") or summary["target"].get("adapter", "")


def read_sessions(case: Case, report: dict) -> None:
    """A KV-cache job's steps must reach the cache's last slot in every session, and it must
    have generated greedily; where its tokens and eager's part from the oracle's is recorded."""
    steps = [s["shape"] for s in report["shapes"]]
    slots = max(s["pos"] + s["seq"] for s in steps)
    short = sorted(
        {s["session"] for s in steps}
        - {s["session"] for s in steps if s["pos"] + s["seq"] == slots}
    )
    if short:
        case.problems.append(f"session(s) {short} stop before the cache's last slot {slots - 1}")
    greedy = report.get("greedy")
    if greedy is None:
        case.problems.append("no greedy generation")
        return
    # Shown beside the verdict, not part of it (as in report.json): in bfloat16 a near tie
    # among a random model's logits may fall either way within the tolerance. Both against
    # the float64 oracle, so that eager's own departures are not read as the artifact's.
    tokens = len(greedy["artifact"])
    case.greedy = ", ".join(
        f"{who} {tokens} same" if parts is None else f"{who} parts at {parts}"
        for who, parts in (
            ("artifact", greedy["artifact_parts_from_oracle_at"]),
            ("eager", greedy["eager_parts_from_oracle_at"]),
        )
    )


def check_bundle(case: Case, bundle: Path, device: str, work: Path) -> None:
    report = work / f"{case.name}-check.json"
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtimes.check",
            str(bundle),
            "--device",
            device,
            "--report",
            str(report),
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    case.check_exit = check.returncode
    (work / f"{case.name}-check.log").write_text(check.stdout + check.stderr)
    if check.returncode != 0:
        case.problems.append(f"bundle check exit {check.returncode}")
    if report.exists() and case.backend == "webgpu":
        checked = json.loads(report.read_text())
        shapes = checked["shapes"]
        case.passed_shapes = f"{sum(s['passed'] for s in shapes)}/{len(shapes)}"
        case.worst_ratio = max(s["ratio"] for s in shapes)
        case.worst_max_abs = max(s["max_abs"] for s in shapes)
        case.target = checked["target"].get("adapter", "")
        if "llvmpipe" in case.target:
            case.problems.append(f"ran on the software adapter {case.target}, not the GPU")


def _last_error(output: str) -> str:
    """The job's last error line (its message), or its last line."""
    lines = output.strip().splitlines() or [""]
    errors = [line for line in lines if "[ERROR]" in line]
    return (errors[-1] if errors else lines[-1])[-300:]


def table(cases: list[Case]) -> str:
    header = (
        "case",
        "job",
        "shapes",
        "worst ratio",
        "worst max_abs",
        "audit",
        "speedup vs eager",
        "decode over floor",
        "greedy vs the oracle",
        "bundle check",
        "seconds",
        "verdict",
    )
    rows = [
        (
            c.name,
            "" if c.job_exit is None else str(c.job_exit),
            c.passed_shapes,
            "" if c.worst_ratio is None else f"{c.worst_ratio:.3g}",
            "" if c.worst_max_abs is None else f"{c.worst_max_abs:.3g}",
            c.audit,
            c.speedup,
            c.floor,
            c.greedy,
            "" if c.check_exit is None else str(c.check_exit),
            f"{c.seconds:.0f}",
            "passed" if c.passed else "FAILED: " + "; ".join(c.problems),
        )
        for c in cases
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in (header, *rows)
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama", help="comma-separated: llama,llama_1b")
    parser.add_argument("--backends", default="eager,aoti")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kv-caches", default="none,static", help="model.kv_cache values")
    parser.add_argument(
        "--quantize",
        default="int4_weight,auto",
        help="comma-separated quantize schemes, each one more case per model and KV cache: "
        "aoti, bfloat16 ('' for none); both compute with CUDA's int4 kernel",
    )
    parser.add_argument("--webgpu-bundle", type=Path, help="a WebGPU bundle to check on Vulkan")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-check"))
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: this machine has no CUDA device; run it on the GPU machine.")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check on {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    cases = [
        Case(model, backend, dtype, kv_cache)
        for model in args.models.split(",")
        for kv_cache in args.kv_caches.split(",")
        for backend in filter(None, args.backends.split(","))
        for dtype in args.dtypes.split(",")
    ]
    cases += [
        Case(model, "aoti", "bfloat16", kv_cache, quantize=scheme)
        for model in args.models.split(",")
        for kv_cache in args.kv_caches.split(",")
        for scheme in filter(None, args.quantize.split(","))
    ]
    for case in cases:
        run_job(case, args.out)
        print(f"{case.name}: {'passed' if case.passed else case.problems}", flush=True)
    if args.webgpu_bundle:
        case = Case("bundle", "webgpu", "float32", device="gpu")
        start = time.perf_counter()
        check_bundle(case, args.webgpu_bundle, "gpu", args.out)
        case.seconds = time.perf_counter() - start
        cases.append(case)
    print(table(cases))
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cases": [asdict(c) | {"passed": c.passed} for c in cases],
    }
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(c.passed for c in cases) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
