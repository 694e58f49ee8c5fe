"""An int4 weight in the CPU kernel's packing (the layout a quantized program stores: bytes of 64
rows at a time along K, exporter/quantize/packed.py), computed on CUDA without repacking it into
tinygemm's tiles, beside tinygemm (`aten._weight_int4pack_mm`, what the aoti package calls
now), per weight shape of a 1B Llama (q/k/v and gate/up fused too):

- one row (a decode step): tinygemm; what Inductor makes of the dequantization and a one-row
  matmul under the decode step's options (one reduction that reads the codes, the RMS norm
  fused before it); a split-K Triton GEMV that reads the packing (`packed_gemv`), at the best
  of a sweep;
- a prompt of 128 and 1024 rows (`--prompts`): tinygemm; the weight dequantized by Inductor,
  then cuBLAS;
- and first, at one row, the weight stored as halves (byte j of a row holds the codes of
  columns j and K/2 + j), which Inductor reads under the decode step's options with the norm
  fused: 2.4 to 3.0 times slower than tinygemm on the H200 (`--halves-only` times only it and
  tinygemm).

Each call is timed inside a CUDA graph whose calls read copies of the weight that together
overflow the L2 cache, as a step of the model reads them (bench/gemv.py).

On an H200 (docs/backends.md), tinygemm won at one row by 3 to 5 times over both readers of the
CPU packing, and lost from 128 rows on by 3.4 to 18.5 times to the dequantization and cuBLAS:
so the package's decode step keeps tinygemm and its prompts go to cuBLAS
(`runtimes.int4_kernels.prompts_through_cublas`).

    python bench/int4_packed.py
    python bench/int4_packed.py --shapes 2048x2048 128256x2048 --prompts 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemv import ROTATED_BYTES, graphed_us, rms_norm
from runtimes.int4_kernels import ROW_BLOCK, for_cuda

SHAPES = ("2048x2048", "6144x2048", "8192x2048", "16384x2048", "2048x8192", "128256x2048")
PROMPTS = (128, 1024)
GROUP = 32
# The GEMV's sweep: slices of K (programs a block of rows), groups a step, warps.
SWEEP = ((1, 2, 4, 8, 16), (1, 2, 4), (2, 4))


@triton.jit
def _packed_gemv_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    partial_ptr,
    rows,
    COLS: tl.constexpr,
    SLICE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """partial[s, r] = the sum over the columns of slice s of w[r, c] * x[c], w = (u - 8) * s + z:
    the program takes the 64 rows of block program_id(0), which lie in COLS runs of 32 bytes
    (rows j and j + 32 in a byte's low and high nibble), and slice program_id(1) of the columns,
    GROUPS groups of GROUP columns a step."""
    block = tl.program_id(0)
    piece = tl.program_id(1)
    lane = tl.arange(0, 32)
    STEP: tl.constexpr = GROUPS * GROUP
    low = tl.zeros((GROUPS, 32), dtype=tl.float32)
    high = tl.zeros((GROUPS, 32), dtype=tl.float32)
    for start in range(piece * SLICE, piece * SLICE + SLICE, STEP):
        col = start + tl.arange(0, STEP)
        codes = tl.load(packed_ptr + block * COLS * 32 + col[:, None] * 32 + lane[None, :])
        x = tl.load(x_ptr + col).to(tl.float32)
        low_sums = tl.sum(
            tl.reshape(((codes & 15).to(tl.float32) - 8.0) * x[:, None], (GROUPS, GROUP, 32)), 1
        )
        high_sums = tl.sum(
            tl.reshape(((codes >> 4).to(tl.float32) - 8.0) * x[:, None], (GROUPS, GROUP, 32)), 1
        )
        x_sums = tl.sum(tl.reshape(x, (GROUPS, GROUP)), 1)
        group = start // GROUP + tl.arange(0, GROUPS)
        at = (group[:, None] * rows + block * 64 + lane[None, :]) * 2
        low += tl.load(scales_ptr + at).to(tl.float32) * low_sums
        low += tl.load(scales_ptr + at + 1).to(tl.float32) * x_sums[:, None]
        high += tl.load(scales_ptr + at + 64).to(tl.float32) * high_sums
        high += tl.load(scales_ptr + at + 65).to(tl.float32) * x_sums[:, None]
    first = piece * rows + block * 64
    tl.store(partial_ptr + first + lane, tl.sum(low, 0))
    tl.store(partial_ptr + first + 32 + lane, tl.sum(high, 0))


def packed_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    slices: int,
    groups: int,
    warps: int,
) -> torch.Tensor:
    """x [1, K] times the packed weight's transpose: float32 partial sums per slice of K, then
    their sum in x's dtype (a second kernel; in a model, Inductor would fuse it into what
    follows)."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    partial = torch.empty(slices, rows, dtype=torch.float32, device=x.device)
    grid = (rows // ROW_BLOCK, slices)
    _packed_gemv_kernel[grid](
        x,
        packed,
        scales_and_zeros,
        partial,
        rows,
        COLS=cols,
        SLICE=cols // slices,
        GROUP=GROUP,
        GROUPS=groups,
        num_warps=warps,
    )
    return partial.sum(0, keepdim=True).to(x.dtype)


def dequantized(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """(u - 8) * s + z [out, in] in bfloat16, in plain ops Inductor fuses into what reads it."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(rows // ROW_BLOCK, cols, 32)
    codes = torch.stack((blocks & 15, blocks >> 4), dim=1).permute(0, 1, 3, 2).reshape(rows, cols)
    scale, zero = (t.t().float().repeat_interleave(GROUP, -1) for t in scales_and_zeros.unbind(-1))
    return ((codes.float() - 8.0) * scale + zero).to(torch.bfloat16)


def halves_product(
    x: torch.Tensor, halves: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """x [1, K] times the transpose of a weight stored as halves: byte j of row r holds the codes
    of columns j (low nibble) and K/2 + j (high), each group's scale and zero in rows [out,
    K / GROUP]. In plain ops: two one-row matmuls over K/2 that read the same bytes, which
    Inductor can compute as one reduction."""
    half = halves.shape[1]
    groups = half // GROUP

    def weight(codes: torch.Tensor, part: slice) -> torch.Tensor:
        shape = (codes.shape[0], groups, GROUP)
        scale = scales[:, part, None].float().expand(shape).reshape(codes.shape)
        zero = zeros[:, part, None].float().expand(shape).reshape(codes.shape)
        return ((codes.float() - 8.0) * scale + zero).to(torch.bfloat16)

    low = weight(halves & 15, slice(0, groups))
    high = weight(halves >> 4, slice(groups, 2 * groups))
    return F.linear(x[:, :half], low) + F.linear(x[:, half:], high)


def _decode_step_compiled(fn: Callable) -> Callable:
    """`fn` compiled with the decode step's options. They are given to torch.compile itself: a
    config patch around the call would be gone by the first call, where Inductor compiles."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, options={"coordinate_descent_tuning": True})


def timed(
    shape: str, prompts: Sequence[int], replays: int, readers_of_cpu_packing: bool = True
) -> list[list[str]]:
    """A row per way of computing a matmul of `shape` ("OUTxIN"): rows of x, what, us, TB/s of
    the weight's bytes, largest difference from tinygemm's product. Without
    `readers_of_cpu_packing`, tinygemm and the halves layout at one row alone."""
    rows, cols = map(int, shape.split("x"))
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
    packed_cpu = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    nbytes = packed_cpu.nbytes + rows * (cols // GROUP) * 4
    copies = int(ROTATED_BYTES / nbytes) + 2
    count = max(copies, 60)
    packed = [packed_cpu.cuda() for _ in range(copies)]
    tiles = [for_cuda(p) for p in packed]
    scales = [
        (torch.randn(cols // GROUP, rows, 2, device="cuda") * 0.01).bfloat16()
        for _ in range(copies)
    ]
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    norm = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    normed = rms_norm(x, norm)

    def each(call: Callable[[int], object]) -> list[Callable[[], object]]:
        return [lambda i=i % copies: call(i) for i in range(count)]

    def tinygemm(i: int, inputs: torch.Tensor = normed) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(inputs, tiles[i], GROUP, scales[i])

    reference = tinygemm(0).float()

    def row(m: int, what: str, us: float, out: torch.Tensor | None) -> list[str]:
        diff = "" if out is None else f"{(out.float() - reference).abs().max().item():.3g}"
        return [shape, str(m), what, f"{us:.2f}", f"{nbytes / 1e6 / us:.2f}", diff]

    found = [row(1, "tinygemm", graphed_us(each(tinygemm), replays), reference)]
    halves_cpu = (codes[:, : cols // 2] | (codes[:, cols // 2 :] << 4)).to(torch.uint8)
    halves = [halves_cpu.cuda() for _ in range(copies)]
    tables = [(t[..., 0].t().contiguous(), t[..., 1].t().contiguous()) for t in scales]
    step = _decode_step_compiled(
        lambda x, norm, p, s, z: halves_product(rms_norm(x, norm), p, s, z)
    )
    out = step(x, norm, halves[0], *tables[0])
    us = graphed_us(each(lambda i: step(x, norm, halves[i], *tables[i])), replays)
    found.append(row(1, "Inductor on halves, norm fused", us, out))
    if not readers_of_cpu_packing:
        return found
    step = _decode_step_compiled(
        lambda x, norm, p, s: F.linear(rms_norm(x, norm), dequantized(p, s))
    )
    out = step(x, norm, packed[0], scales[0])
    us = graphed_us(each(lambda i: step(x, norm, packed[i], scales[i])), replays)
    found.append(row(1, "Inductor, norm fused", us, out))
    best: tuple[float, str, torch.Tensor | None] = (float("inf"), "", None)
    for slices, groups, warps in itertools.product(*SWEEP):
        if cols % (slices * groups * GROUP):
            continue

        def gemv(i: int, s: int = slices, g: int = groups, w: int = warps) -> torch.Tensor:
            return packed_gemv(normed, packed[i], scales[i], s, g, w)

        us = graphed_us(each(gemv), max(3, replays // 2))
        if us < best[0]:
            best = (us, f"Triton GEMV, {slices} slices, {groups} groups, {warps} warps", gemv(0))
    found.append(row(1, best[1], best[0], best[2]))
    dequantize = _decode_step_compiled(dequantized)
    for m in prompts:
        prompt = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
        us = graphed_us(each(lambda i, p=prompt: tinygemm(i, p)), max(3, replays // 2))
        found.append(row(m, "tinygemm", us, None))
        us = graphed_us(
            each(lambda i, p=prompt: F.linear(p, dequantize(packed[i], scales[i]))),
            max(3, replays // 2),
        )
        found.append(row(m, "Inductor's dequantization, then cuBLAS", us, None))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="OUTxIN")
    parser.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS), help="rows")
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument(
        "--halves-only",
        action="store_true",
        help="one row: tinygemm and Inductor on the halves layout alone (no prompts)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/int4_packed.py times CUDA kernels; this machine has no CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name()}, group {GROUP}, weights rotated past L2, medians")
    headers = ["weight", "rows", "matmul", "us", "TB/s", "max diff"]
    found = []
    for shape in args.shapes:
        rows = timed(shape, args.prompts, args.replays, not args.halves_only)
        print(tabulate(rows, disable_numparse=True), flush=True)
        found += rows
    print(tabulate(found, headers=headers, disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
