"""Inductor's options and the backend's settings side by side for a KV-cache model's decode step
through AOTInductor on CUDA: the model exported once per quantize scheme (as the job exports
it, from Hydra overrides of the job's config), compiled once per variant, each package's kernels
per decode step counted, and then all of them timed in one process by bench/kv_decode.py,
beside the float program under `torch.compile(mode="reduce-overhead")`, with each decode step
over the memory floor of its package (the time to read its bytes at the card's peak bandwidth).

    python bench/aoti_options.py model=llama_1b model.num_key_value_heads=32 \\
        --variants project no_decode_step unfused_projections --quantize none int4_weight
    python bench/aoti_options.py model=llama_1b model.num_key_value_heads=32 \\
        dynamic.seq.max=1024 --slots 2048 --variants project --prefills 128 1024 --eager \\
        --max-prefill 1024

`project` is the package the backend makes (exporter/backends/aoti.py: the program, and its
decode step compiled apart where `backend.decode_step`'s default makes it, its int4 projections
of one input fused where `backend.fused_projections`' does). Every other variant is `+`-joined
parts, each adding options to the backend's own (`freezing`), or making the decode step or
leaving it out whatever the default (`decode_step`, `no_decode_step`: every call runs the
program as exported, its matmuls' rows symbolic), or fusing the int4 projections or not
(`fused_projections`, `unfused_projections`), or computing the decode step's attention by the
project's kernel or not (`decode_attention`, `no_decode_attention`). The kernel census
profiles one decode step run without a CUDA graph: the kernels and their summed time on the
GPU, the largest by time (`--top`), and the first in launch order (`--sequence`: a layer's
kernels one by one). Its counts before 2026-11-29 held one copy of the bench's own, the
position sent to the GPU inside the profile: one more than the package's kernels.
`--prefills` times prompts of those lengths too (bench/kv_decode.py), each within the program's
`dynamic.seq.max`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import kv_decode
from exporter import export, models, quantize
from exporter.backends import aoti
from exporter.benchmark import memory_floor
from exporter.command import schemas
from exporter.config import to_job
from exporter.export import Exported
from runtimes.loaders.aoti import _load, _share_libstdcxx, calls

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# Each variant's options on top of the backend's own.
VARIANTS: dict[str, dict[str, object]] = {
    "project": {},
    # Constant weights folded into the program: Inductor's freezing passes concatenate the
    # weights of projections that read the same input (q/k/v, gate/up) into one matmul.
    "freezing": {"freezing": True},
    # Each Triton kernel's block sizes tuned by coordinate descent from the heuristic's choice
    # (the decode step is compiled with it already).
    "coordinate_descent": {"coordinate_descent_tuning": True},
    # Triton templates for the matmuls, benchmarked against cuBLAS at compile time.
    "max_autotune": {"max_autotune": True},
    # Independent kernels (the k and v projections' reductions of one input) combined into one
    # launch: a 4-layer decode step's 47 kernels left some 75 us of gaps in its 0.436 ms.
    "combo_kernels": {"combo_kernels": True},
    # Hopper's programmatic dependent launch: a kernel's start overlaps its predecessor's end.
    "pdl": {"triton.enable_pdl": True},
}
# backend.decode_step=true and false.
DECODE_STEP = {"decode_step": True, "no_decode_step": False}
# backend.fused_projections=true and false.
FUSED_PROJECTIONS = {"fused_projections": True, "unfused_projections": False}
# backend.decode_attention=true and false.
DECODE_ATTENTION = {"decode_attention": True, "no_decode_attention": False}
PARTS = (*VARIANTS, *DECODE_STEP, *FUSED_PROJECTIONS, *DECODE_ATTENTION)


def exported_program(overrides: Sequence[str], out: Path) -> Exported:
    """The job's export of the model that `overrides` compose, with a static KV cache."""
    schemas.register_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose(
            "config",
            [
                *overrides,
                "backend=aoti",
                "backend.device=cuda",
                "model.kv_cache=static",
                "mlflow=off",
            ],
        )
    job = to_job(cfg)
    bundle = models.build(job.model, job.dynamic)
    if job.quantize.enabled:
        bundle = quantize.quantized(bundle, job.quantize, None, job.backend.int4_weight_packed)
    return export.run(bundle, job.export, out)


def compiled(exported: Exported, variant: str, package: Path) -> float:
    """Seconds to compile the exported program for this GPU into `package` as the backend does,
    with what `variant`'s parts change."""
    parts = variant.split("+")
    # Loaded anew: moving a program to the GPU moves its own weights (move_to_device_pass).
    program = torch.export.load(exported.path)
    options: dict[str, object] = {}
    backend = aoti.AotiConfig(device="cuda")
    for part in parts:
        options.update(VARIANTS.get(part, {}))
        backend.decode_step = DECODE_STEP.get(part, backend.decode_step)
        backend.fused_projections = FUSED_PROJECTIONS.get(part, backend.fused_projections)
        backend.decode_attention = DECODE_ATTENTION.get(part, backend.decode_attention)
    started = time.perf_counter()
    aoti.compile_package(program, aoti.one_token_call(exported), backend, package, options)
    return time.perf_counter() - started


@dataclass
class Census:
    """One decode step's kernels: how many launches, their summed GPU time in ms, the largest by
    time (name, launches, ms), and the first ones in launch order (name, us)."""

    launches: int
    total_ms: float
    largest: list[tuple[str, int, float]]
    in_order: list[tuple[str, float]]


def kernel_census(package: Path, top: int, first: int) -> Census:
    """One decode step of `package` (at slot 1, after a one-token prefill): its kernels, the
    `top` by time and the `first` in launch order. Its inputs are on the GPU before the
    profile starts, so that it holds the package's work alone."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    model = calls(_load(package, single_threaded=False))
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    for position in range(3):
        model(token, torch.tensor([position], device="cuda"))
    position = torch.tensor([1], device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        model(token, position)
        torch.cuda.synchronize()
    kernels = [e for e in profiled.key_averages() if e.device_type == DeviceType.CUDA]
    largest = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    launched = [e for e in profiled.events() if e.device_type == DeviceType.CUDA]
    launched.sort(key=lambda e: e.time_range.start)
    return Census(
        launches=sum(e.count for e in kernels),
        total_ms=sum(e.self_device_time_total for e in kernels) / 1e3,
        largest=[(e.key[:70], e.count, e.self_device_time_total / 1e3) for e in largest],
        in_order=[(e.name[:70], e.time_range.elapsed_us()) for e in launched[:first]],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job's config")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["project", "no_decode_step"],
        type=_variant,
        help=f"+-joined parts of {', '.join(PARTS)}",
    )
    parser.add_argument("--slots", type=int, default=1024, help="the cache's length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=6, help="kernels listed per variant")
    parser.add_argument(
        "--sequence",
        type=int,
        default=0,
        help="the first kernels of a step listed in launch order, per variant (a layer's)",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/aoti-options"))
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument(
        "--eager", action="store_true", help="time the float program in eager PyTorch too"
    )
    parser.add_argument(
        "--prefills",
        type=int,
        nargs="+",
        default=[1],
        help="prompt lengths timed beside the decode steps (each within dynamic.seq.max)",
    )
    parser.add_argument(
        "--max-prefill",
        type=int,
        default=1,
        help="the longest prefill filling the cache before a decode step (<= dynamic.seq.max)",
    )
    parser.add_argument(
        "--quantize", nargs="+", default=["none"], help="quantize schemes, each exported apart"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/aoti_options.py times packages on CUDA; this machine has no CUDA device")
        return 2
    _share_libstdcxx()
    rows, packages, float_program = [], [], None
    for scheme in args.quantize:
        out = args.out / scheme
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        overrides = [*args.overrides, f"model.max_cache_len={args.slots}", f"quantize={scheme}"]
        exported = exported_program(overrides, out)
        print(f"{scheme}: exported in {time.perf_counter() - started:.0f} s: {exported.path}")
        if scheme == "none":
            float_program = exported.path
        for variant in args.variants:
            name = variant if scheme == "none" else f"{variant}-{scheme}"
            package = out / "packages" / f"{variant}.pt2"
            package.parent.mkdir(exist_ok=True)
            try:
                seconds = compiled(exported, variant, package)
            except Exception as error:
                print(f"{name}: compiling failed: {type(error).__name__}: {error}"[:400])
                continue
            census = kernel_census(package, args.top, args.sequence)
            floor = memory_floor.on("cuda", package.stat().st_size)
            floor_ms = f"{floor.ms:.3f}" if floor else None
            rows.append(
                [name, f"{seconds:.0f}", census.launches, f"{census.total_ms:.3f}", floor_ms]
            )
            print(
                f"{name}: compiled in {seconds:.0f} s; "
                f"{census.launches} kernels, {census.total_ms:.3f} ms:"
            )
            for kernel, count, ms in census.largest:
                print(f"    {ms:8.3f} ms  {count:3d} x  {kernel}")
            if census.in_order:
                print(f"  the first {len(census.in_order)} in launch order:")
            for kernel, us in census.in_order:
                print(f"    {us:8.1f} us  {kernel}")
            sys.stdout.flush()
            packages.append(f"{name}=aoti:{package}")
    print(
        tabulate(
            rows,
            headers=["variant", "compile s", "kernels/step", "kernel ms", "floor ms"],
            disable_numparse=True,
        ),
        flush=True,
    )
    # torch.compile of the float program only: a quantized one calls the CPU's int4 kernel,
    # which only the aoti lowering for CUDA replaces.
    compiled_too = float_program is not None and not args.no_compile
    contenders = [*packages, f"compiled=compile:{float_program}"] if compiled_too else packages
    if args.eager and float_program is not None:
        contenders = [*contenders, f"eager={float_program}"]
    timing = [
        "--slots",
        str(args.slots),
        "--max-prefill",
        str(args.max_prefill),
        "--device",
        "cuda",
    ]
    timing += ["--prefills", *map(str, args.prefills)]
    return kv_decode.main([*contenders, *timing, "--rounds", str(args.rounds)])


def _variant(value: str) -> str:
    unknown = [part for part in value.split("+") if part not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{value!r}: no part {unknown[0]!r} in {PARTS}")
    return value


if __name__ == "__main__":
    sys.exit(main())
