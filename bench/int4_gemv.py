"""One row times an int4 weight on CUDA, per weight shape of a 1B Llama: CUDA's int4 kernel
(`aten._weight_int4pack_mm`, tinygemm), which the aoti package calls, beside a candidate for a
decode step's matmuls, a Triton GEMV that reads the same tiles (`int4_gemv` below), each call
timed inside a CUDA graph of 100 calls (the medians of several replays), with the bandwidth
each reads its weight at and the largest difference between the two.

tinygemm computes tiles of 16 rows, 15 of them padding at batch 1, and read a 1B model's int4
weights at 0.9 TB/s in its decode step on an H200 (docs/backends.md). The candidate lost at
every shape there (0.24x to 0.60x of tinygemm's speed): each 32-bit word of codes gathers 8
inputs, and with 8 rows a program the input loads outnumber the weight's. It is here for the
next attempt (inputs permuted into the tiles' order once, more rows a program, split K), not in
the product.

    python bench/int4_gemv.py --group 32
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemv import graphed_us
from runtimes import int4_kernels

# [out, in] of Llama-3.2-1B's projections and head.
SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192), (128256, 2048))
CALLS = 100
_ROW_TILES = ((4096, 1), (16384, 2))
_WIDE_ROW_TILES = 8


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    tiles_ptr,
    scales_ptr,
    out_ptr,
    rows,
    cols,
    group,
    PAIRS: tl.constexpr,
    ROW_TILES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[r] = sum over c of ((u[r, c] - 8) * s + z) * x[c], s and z the scale and zero of
    row r and group c // group. The tiles hold 8 rows in K consecutive int32; int32 f of a row
    tile is lane (f // PAIRS) % 32 of chunk f // PAIRS // 32 * PAIRS + f % PAIRS of 32 columns:
    row lane // 4 of the tile, its nibble n (bits 4n..4n+3) the code of column
    32 * chunk + 2 * (lane % 4 + 4 * (n % 4)) + n // 4. A chunk lies in one group."""
    first = tl.program_id(0) * ROW_TILES
    tile = first + tl.arange(0, ROW_TILES)
    acc = tl.zeros((ROW_TILES, BLOCK), dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        f = start + tl.arange(0, BLOCK)
        lane = (f // PAIRS) % 32
        chunk = f // (32 * PAIRS) * PAIRS + f % PAIRS
        row = tile[:, None] * 8 + (lane // 4)[None, :]
        words = tl.load(tiles_ptr + tile[:, None] * cols + f[None, :])
        base = 32 * chunk + 2 * (lane % 4)
        coded = tl.zeros((ROW_TILES, BLOCK), dtype=tl.float32)
        plain = tl.zeros((BLOCK,), dtype=tl.float32)
        for n in tl.static_range(8):
            x = tl.load(x_ptr + base + 8 * (n % 4) + n // 4).to(tl.float32)
            code = ((words >> (4 * n)) & 0xF).to(tl.float32)
            coded += (code - 8.0) * x[None, :]
            plain += x
        at = ((32 * chunk // group)[None, :] * rows + row) * 2
        scale = tl.load(scales_ptr + at).to(tl.float32)
        zero = tl.load(scales_ptr + at + 1).to(tl.float32)
        acc += scale * coded + zero * plain[None, :]
    # Each row's sum is over the lanes of its tile that hold it: f's lane // 4.
    by_lane = tl.reshape(acc, (ROW_TILES, BLOCK // (32 * PAIRS), 8, 4 * PAIRS))
    out = tl.sum(tl.sum(by_lane, axis=3), axis=1)
    out_rows = tile[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty))


def int4_gemv(
    x: torch.Tensor, tiles: torch.Tensor, group: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """`aten._weight_int4pack_mm(x, tiles, group, scales_and_zeros)` for x of one row [1, K]."""
    rows, cols = tiles.shape[0] * 8, x.shape[-1]
    pairs = tiles.shape[-1]
    out = torch.empty((1, rows), dtype=x.dtype, device=x.device)
    row_tiles = next((count for most, count in _ROW_TILES if rows <= most), _WIDE_ROW_TILES)
    # A block of int32 covers whole chunks of 32 columns (16 * tiles columns divide K, and 256)
    # and divides the row tile's K.
    block = math.gcd(cols, 256)
    grid = (rows // 8 // row_tiles,)
    _int4_gemv_kernel[grid](
        x,
        tiles,
        scales_and_zeros,
        out,
        rows,
        cols,
        group,
        PAIRS=pairs,
        ROW_TILES=row_tiles,
        BLOCK=block,
    )
    return out


def _calls(op: Callable[..., torch.Tensor], inputs: tuple) -> list[Callable[[], object]]:
    """CALLS calls of `op(*inputs)`: one weight read over and over, as tinygemm's tiles and ours
    are compared (both from L2 where they fit; bench/gemv.py rotates weights past it)."""
    return [lambda: op(*inputs)] * CALLS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/int4_gemv.py times CUDA kernels; this machine has no CUDA device")
        return 2
    rows = []
    for out, width in SHAPES:
        codes = torch.randint(0, 16, (out, width), dtype=torch.int32, device="cuda")
        plain = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        tiles = torch.ops.aten._convert_weight_to_int4pack(plain, 8 if width % 128 == 0 else 4)
        assert tiles.shape == int4_kernels.cuda_shape(out, width)
        scales = (torch.randn(width // args.group, out, 2, device="cuda") * 0.01).bfloat16()
        x = torch.randn(1, width, device="cuda").bfloat16()
        theirs = torch.ops.aten._weight_int4pack_mm(x, tiles, args.group, scales)
        ours = int4_gemv(x, tiles, args.group, scales)
        error = (ours.float() - theirs.float()).abs().max().item()
        megabytes = (tiles.nbytes + scales.nbytes) / 1e6
        inputs = (x, tiles, args.group, scales)
        cuda_us = graphed_us(_calls(torch.ops.aten._weight_int4pack_mm, inputs), args.replays)
        ours_us = graphed_us(_calls(int4_gemv, inputs), args.replays)
        rows.append(
            [
                f"{out} x {width}",
                f"{megabytes:.1f}",
                f"{cuda_us:.1f} ({megabytes / cuda_us:.2f} TB/s)",
                f"{ours_us:.1f} ({megabytes / ours_us:.2f} TB/s)",
                f"{cuda_us / ours_us:.2f}x",
                f"{error:.3g} of {theirs.abs().max().item():.3g}",
            ]
        )
    headers = ["weight", "MB", "CUDA's int4 kernel us", "ours us", "ours faster", "max diff"]
    print(f"group {args.group}, {CALLS} calls a graph, medians of {args.replays} replays")
    print(tabulate(rows, headers=headers, disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
