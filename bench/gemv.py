"""One row times a bfloat16 weight on CUDA, per weight shape of a 1B Llama's decode step:
cuBLAS (`F.linear`), what Inductor makes of the decode step's RMS norm and projection under
its options (the decode step's own first), and a plain Triton GEMV at the best of a sweep of
block sizes, each timed inside a CUDA graph whose calls read copies of the weight that together
overflow the L2 cache, as a step of the model does (one weight timed over and over stays in
L2 and reads faster than the model ever will).

It asks how much of a decode step's time over the floor a better GEMV would take back. On an
H200 (docs/backends.md), a 2048 x 2048 projection takes about 4 us at best, 2.3 times what its
bytes take at the card's bandwidth: a kernel's launch and ramp are a floor of their own.

    python bench/gemv.py
    python bench/gemv.py --shapes 2048x2048 --options cdt_all autotune autotune_all
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tabulate import tabulate

# [out, in] of Llama-3.2-1B's projections, q/k/v and gate/up fused, and its head.
SHAPES = ("2048x2048", "6144x2048", "8192x2048", "16384x2048", "2048x8192", "128256x2048")
# What the copies of a weight that one graph reads add up to at least: past any card's L2.
ROTATED_BYTES = 400e6
# Inductor's options for the norm and projection, on top of its defaults; `decode_step` is what
# exporter/backends/aoti.py compiles the decode step with.
OPTIONS: dict[str, dict[str, object]] = {
    "decode_step": {"coordinate_descent_tuning": True},
    "cdt_all": {
        "coordinate_descent_tuning": True,
        "coordinate_descent_check_all_directions": True,
        "coordinate_descent_search_radius": 2,
    },
    "autotune": {
        "coordinate_descent_tuning": True,
        "max_autotune": True,
        "max_autotune_pointwise": True,
    },
    "autotune_all": {
        "coordinate_descent_tuning": True,
        "max_autotune": True,
        "max_autotune_pointwise": True,
        "coordinate_descent_check_all_directions": True,
        "coordinate_descent_search_radius": 2,
    },
    "no_persistent": {"coordinate_descent_tuning": True, "triton.persistent_reductions": False},
}
# The Triton GEMV's sweep: rows a program, columns a step, warps.
SWEEP = ((1, 2, 4, 8, 16), (128, 256, 512, 1024), (2, 4, 8))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, rows, COLS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr
):
    """out[r] = sum over c of w[r, c] * x[c], BR rows a program, BC columns a step."""
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    for start in range(0, COLS, BC):
        col = start + tl.arange(0, BC)
        x = tl.load(x_ptr + col).to(tl.float32)
        w = tl.load(w_ptr + row[:, None] * COLS + col[None, :], mask=row[:, None] < rows, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + row, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row < rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Llama's RMS norm, in float32 as transformers computes it."""
    values = x.float()
    values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + 1e-5)
    return (values * weight.float()).to(x.dtype)


def graphed_us(calls: Sequence[Callable[[], object]], replays: int) -> float:
    """The median time of one of `calls`, in microseconds, all of them replayed in one CUDA
    graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def int4_main(
    argv: Sequence[str] | None,
    doc: str,
    script: str,
    shapes: Sequence[str],
    group: int,
    timed: Callable[[str, int], list[list[str]]],
) -> int:
    """The command line of an int4 GEMV's bench (`script`, described by `doc`'s first
    paragraph): `timed`'s rows for each of `shapes` ("OUTxIN"), then the table of them all."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(shapes), help="OUTxIN")
    parser.add_argument("--replays", type=int, default=15)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{script} times CUDA kernels; this machine has no CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name()}, group {group}, weights rotated past L2, medians")
    headers = ["weight", "MB", "GEMV", "us", "TB/s", "max diff"]
    found: list[list[str]] = []
    for shape in args.shapes:
        rows = timed(shape, args.replays)
        found += rows
        print(tabulate(rows, disable_numparse=True), flush=True)
    print(tabulate(found, headers=headers, disable_numparse=True))
    return 0


def timed(shape: str, options: Sequence[str], replays: int) -> list[tuple[str, float, float]]:
    """(what, us, largest difference from float32's product) per way of computing a projection
    of `shape` ("OUTxIN")."""
    rows, cols = map(int, shape.split("x"))
    copies = int(ROTATED_BYTES / (rows * cols * 2)) + 2
    count = max(copies, 60)
    weights = [
        torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
    ]
    x = torch.randn(1, 1, cols, device="cuda", dtype=torch.bfloat16)
    norm = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    normed = rms_norm(x, norm).view(1, cols)
    reference = F.linear(normed.float(), weights[0].float())

    def difference(out: torch.Tensor) -> float:
        return (out.float().view(1, rows) - reference).abs().max().item()

    def each(call: Callable[[torch.Tensor], object]) -> list[Callable[[], object]]:
        return [lambda w=weights[i % copies]: call(w) for i in range(count)]

    results = [
        (
            "cuBLAS",
            graphed_us(each(lambda w: F.linear(normed, w)), replays),
            difference(F.linear(normed, weights[0])),
        )
    ]
    for name in options:
        torch._dynamo.reset()
        with torch._inductor.config.patch(OPTIONS[name]):
            step = torch.compile(lambda x, norm, w: F.linear(rms_norm(x, norm), w), dynamic=False)
            out = step(x, norm, weights[0])
            us = graphed_us(each(lambda w, step=step: step(x, norm, w)), replays)
        results.append((f"Inductor, norm fused, {name}", us, difference(out)))
    out = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
    best, best_difference = (float("inf"), ""), float("nan")
    for block_rows, block_cols, warps in itertools.product(*SWEEP):
        if block_rows * block_cols > 16384 or block_cols > cols:
            continue

        def gemv(
            w: torch.Tensor, br: int = block_rows, bc: int = block_cols, nw: int = warps
        ) -> None:
            grid = (triton.cdiv(rows, br),)
            _gemv_kernel[grid](normed, w, out, rows, cols, BR=br, BC=bc, num_warps=nw)

        us = graphed_us(each(gemv), max(3, replays // 2))
        if us < best[0]:
            gemv(weights[0])
            best = (us, f"Triton, {block_rows} rows x {block_cols} cols, {warps} warps")
            best_difference = difference(out)
    results.append((best[1], best[0], best_difference))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="OUTxIN")
    parser.add_argument(
        "--options", nargs="+", default=["decode_step"], choices=list(OPTIONS), help="Inductor's"
    )
    parser.add_argument("--replays", type=int, default=15)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gemv.py times CUDA kernels; this machine has no CUDA device")
        return 2
    card = torch.cuda.get_device_name()
    print(f"{card}, weights rotated past {ROTATED_BYTES / 1e6:.0f} MB, medians")
    rows = []
    for shape in args.shapes:
        out, width = map(int, shape.split("x"))
        megabytes = out * width * 2 / 1e6
        for what, us, diff in timed(shape, args.options, args.replays):
            rows.append(
                [
                    shape,
                    f"{megabytes:.1f}",
                    what,
                    f"{us:.2f}",
                    f"{megabytes / us:.2f}",
                    f"{diff:.3g}",
                ]
            )
        print(tabulate(rows[-len(args.options) - 2 :], disable_numparse=True), flush=True)
    print(
        tabulate(
            rows, headers=["weight", "MB", "GEMV", "us", "TB/s", "max diff"], disable_numparse=True
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
