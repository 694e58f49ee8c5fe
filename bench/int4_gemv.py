"""One row times an int4 weight in CUDA's tiles, per weight shape of a 1B Llama's decode step
(q/k/v and gate/up fused too): CUDA's int4 kernel (`aten._weight_int4pack_mm`, tinygemm), which
the aoti package's decode step calls, beside a Triton GEMV that reads the same tiles
(`product` below) at the best of a sweep of its block sizes. Each call is timed inside a
CUDA graph whose calls read copies of the weight that together overflow the L2 cache, as a step
of the model reads them (bench/gemv.py).

tinygemm computes tiles of 16 rows, 15 of them padding at batch 1, and reads a 1B model's int4
weights at 0.9 TB/s in its decode step on an H200 (docs/backends.md). A first GEMV over its
tiles, 8 rows a program and no split of K, lost at every shape (0.24x to 0.60x of tinygemm's
speed): each int32 of codes gathers 8 inputs, and with so few rows a program the input loads
outnumbered the weight's. This one shares each step's inputs among up to 128 rows and splits K
among programs, whose float32 partial sums a second kernel adds (timed with it, and without it:
in a model, Inductor would fuse that sum into what reads the product). It came within 0.83x to
0.93x of tinygemm's speed on the H200 and still lost at every shape, its partial sums alone:
likely because on CUDA's cores each code costs a shift, a mask and two floating-point
operations, where tinygemm hands the codes to tensor cores. It stays a bench candidate, not in
the product.

    python bench/int4_gemv.py
    python bench/int4_gemv.py --shapes 2048x2048 --replays 30
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemv import ROTATED_BYTES, graphed_us, int4_main
from runtimes import int4_kernels

SHAPES = ("2048x2048", "6144x2048", "16384x2048", "2048x8192", "128256x2048")
GROUP = 32
# The sweep: row tiles (of 8 rows) a program, slices of K, int32 of a row tile a step, warps.
SWEEP = ((2, 4, 8, 16), (1, 2, 4, 8), (128, 256), (4, 8))


@triton.jit
def _tiles_gemv_kernel(
    x_ptr,
    tiles_ptr,
    scales_ptr,
    out_ptr,
    rows,
    COLS: tl.constexpr,
    GROUP: tl.constexpr,
    PAIRS: tl.constexpr,
    ROW_TILES: tl.constexpr,
    SLICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[slice, r] = the sum over slice program_id(1) of int32 f of row r's tile of
    ((u - 8) * s + z) * x[c], for the ROW_TILES tiles of program_id(0). A row tile holds 8 rows
    in COLS consecutive int32: int32 f of it is lane (f // PAIRS) % 32 of chunk
    f // (32 * PAIRS) * PAIRS + f % PAIRS of 32 columns, row lane // 4 of the tile, its nibble
    n the code of column 32 * chunk + 2 * (lane % 4) + 8 * (n % 4) + n // 4
    (runtimes/int4_kernels.py). A chunk lies in one group, so each int32 has one scale."""
    tile = tl.program_id(0) * ROW_TILES + tl.arange(0, ROW_TILES)
    piece = tl.program_id(1)
    acc = tl.zeros((ROW_TILES, BLOCK), dtype=tl.float32)
    for start in range(piece * SLICE, piece * SLICE + SLICE, BLOCK):
        f = start + tl.arange(0, BLOCK)
        lane = (f // PAIRS) % 32
        chunk = f // (32 * PAIRS) * PAIRS + f % PAIRS
        words = tl.load(tiles_ptr + tile[:, None] * COLS + f[None, :])
        base = 32 * chunk + 2 * (lane % 4)
        dot = tl.zeros((ROW_TILES, BLOCK), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK,), dtype=tl.float32)
        for n in tl.static_range(8):
            x = tl.load(x_ptr + base + 8 * (n % 4) + n // 4).to(tl.float32)
            # u - 8 without an int-to-float conversion (a quarter-rate instruction): the code
            # as the mantissa of 2**23's float, less 2**23 + 8.
            code = ((words >> (4 * n)) & 0xF) | 0x4B000000
            dot += (code.to(tl.float32, bitcast=True) - 8388616.0) * x[None, :]
            x_sum += x
        row = tile[:, None] * 8 + (lane // 4)[None, :]
        at = ((32 * chunk // GROUP)[None, :] * rows + row) * 2
        scale = tl.load(scales_ptr + at).to(tl.float32)
        zero = tl.load(scales_ptr + at + 1).to(tl.float32)
        acc += scale * dot + zero * x_sum[None, :]
    # Each row's sum is over the int32 of its tile that hold it: those of lane // 4.
    by_lane = tl.reshape(acc, (ROW_TILES, BLOCK // (32 * PAIRS), 8, 4 * PAIRS))
    out = tl.sum(tl.sum(by_lane, axis=3), axis=1)
    out_rows = tile[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(out_ptr + piece * rows + out_rows, out.to(out_ptr.dtype.element_ty))


def partial_sums(
    x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor, point: tuple[int, ...]
) -> torch.Tensor:
    """x [1, K] times the weight in CUDA's tiles, transposed, at a sweep point (row tiles a
    program, slices of K, int32 a step, warps): partial sums [slices, out], in float32 (in x's
    dtype where K is not split)."""
    row_tiles, slices, block, warps = point
    rows, cols = tiles.shape[0] * 8, x.shape[-1]
    dtype = x.dtype if slices == 1 else torch.float32
    out = torch.empty(slices, rows, dtype=dtype, device=x.device)
    _tiles_gemv_kernel[(rows // 8 // row_tiles, slices)](
        x,
        tiles,
        scales_and_zeros,
        out,
        rows,
        COLS=cols,
        GROUP=GROUP,
        PAIRS=tiles.shape[-1],
        ROW_TILES=row_tiles,
        SLICE=cols // slices,
        BLOCK=block,
        num_warps=warps,
    )
    return out


def product(
    x: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor, point: tuple[int, ...]
) -> torch.Tensor:
    """`aten._weight_int4pack_mm(x, tiles, GROUP, scales_and_zeros)` [1, out] by the GEMV."""
    partials = partial_sums(x, tiles, scales_and_zeros, point)
    return partials if point[1] == 1 else partials.sum(0, keepdim=True).to(x.dtype)


def fits(rows: int, cols: int, row_tiles: int, slices: int, block: int) -> bool:
    """Whether a sweep point divides the weight and launches a sensible number of programs."""
    programs = rows // 8 // row_tiles * slices
    return (
        rows % (8 * row_tiles) == 0
        and cols % (slices * block) == 0
        and row_tiles * block <= 4096
        and 64 <= programs <= 16384
    )


def timed(shape: str, replays: int) -> list[list[str]]:
    """tinygemm, then our best with and without the partial sums' addition, for `shape`."""
    rows, cols = map(int, shape.split("x"))
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32, device="cuda")
    plain = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    first = torch.ops.aten._convert_weight_to_int4pack(plain, 8 if cols % 128 == 0 else 4)
    assert first.shape == int4_kernels.cuda_shape(rows, cols)
    nbytes = first.nbytes + rows * (cols // GROUP) * 4
    copies = int(ROTATED_BYTES / nbytes) + 2
    count = max(copies, 60)
    tiles = [first] + [first.clone() for _ in range(copies - 1)]
    scales = [
        (torch.randn(cols // GROUP, rows, 2, device="cuda") * 0.01).bfloat16()
        for _ in range(copies)
    ]
    x = torch.randn(1, cols, device="cuda").bfloat16()
    reference = torch.ops.aten._weight_int4pack_mm(x, tiles[0], GROUP, scales[0]).float()

    def each(call: Callable[[int], object]) -> list[Callable[[], object]]:
        return [lambda i=i % copies: call(i) for i in range(count)]

    def row(what: str, us: float, out: torch.Tensor) -> list[str]:
        diff = (out.float().view(1, rows) - reference).abs().max().item()
        return [
            shape,
            f"{nbytes / 1e6:.1f}",
            what,
            f"{us:.2f}",
            f"{nbytes / 1e6 / us:.2f}",
            f"{diff:.3g}",
        ]

    tinygemm_us = graphed_us(
        each(lambda i: torch.ops.aten._weight_int4pack_mm(x, tiles[i], GROUP, scales[i])), replays
    )
    found = [row("tinygemm", tinygemm_us, reference)]
    # The best point without the partials' sum, and with it (the same where K is not split).
    alone: tuple[float, tuple[int, ...]] = (float("inf"), ())
    summed: tuple[float, tuple[int, ...]] = (float("inf"), ())
    for point in itertools.product(*SWEEP):
        if not fits(rows, cols, *point[:3]):
            continue
        us = graphed_us(each(lambda i, p=point: partial_sums(x, tiles[i], scales[i], p)), 5)
        alone = min(alone, (us, point))
        if point[1] > 1:
            us = graphed_us(each(lambda i, p=point: product(x, tiles[i], scales[i], p)), 5)
        summed = min(summed, (us, point))
    for label, (_, point), call in (
        ("partials alone", alone, partial_sums),
        ("with their sum", summed, product),
    ):
        us = graphed_us(each(lambda i, p=point, c=call: c(x, tiles[i], scales[i], p)), replays)
        tiles_, slices, block, warps = point
        what = f"ours, {label}: {tiles_} row tiles, {slices} slices, {block} a step, {warps} warps"
        found.append(row(what, us, product(x, tiles[0], scales[0], point)))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    return int4_main(argv, __doc__, "bench/int4_gemv.py", SHAPES, GROUP, timed)


if __name__ == "__main__":
    sys.exit(main())
