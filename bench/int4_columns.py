"""One row times an int4 weight on CUDA in a layout made for one row, beside CUDA's int4 kernel
(tinygemm) on its tiles, per weight shape of a 1B Llama's decode step (q/k/v and gate/up fused
too). Each call is timed inside a CUDA graph whose calls read copies of the weight that together
overflow the L2 cache (bench/gemv.py).

The layout: a weight's codes in int32 words along K, words [in // 8, out], code 8w + j of an
output in bits 4j of word w; tinygemm's own table [in // group, out] of scales and zeros, a
group's pair one int32 (bfloat16 scale low, zero high). A thread sums whole outputs, and the
inputs of a word are one load for all of them. No code is converted to a float: masked into
bits 15 to 18 of the float 128.0 it is 128 + u/2 (bits 19 to 22: 128 + 8u), one integer
operation a code, its input taken twice (an eighth); the 128s come off once a word, from the
sums of the inputs. tinygemm computes tiles of 16 rows, 15 of them padding at batch 1.

It wins where a weight has many outputs (1.29x tinygemm's speed for the head on an H200) and
loses at 2048 outputs; over a step of the model it would save about 5% (docs/backends.md). It
stays a bench candidate, not in the product.

    python bench/int4_columns.py
    python bench/int4_columns.py --shapes 128256x2048 --replays 30
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

SHAPES = ("2048x2048", "6144x2048", "16384x2048", "2048x8192", "128256x2048")
GROUP = 32
# The sweep: outputs a program, words of an output a step, warps.
SWEEP = ((16, 32, 64, 128), (32, 64, 128, 256), (4, 8))
# The most int32 a program's step loads: the sweep's cap on a step's tile.
MOST_WORDS = 16384


@triton.jit
def _word_sums(words, x_ptr, first):
    """For int32 words of 8 codes, and the offsets of their first inputs in x (a shape that
    broadcasts against them): the sum over each word of u * x, and of x."""
    dot = tl.zeros(words.shape, dtype=tl.float32)
    x_sum = tl.zeros(first.shape, dtype=tl.float32)
    magic = tl.zeros(first.shape, dtype=tl.float32)
    for j in tl.static_range(0, 8, 2):
        # Codes j and j + 1 at bits 15-18 and 19-22 of the float 128.0.
        shifted = words << (15 - 4 * j) if j < 4 else words >> (4 * j - 15)
        low = ((shifted & 0x00078000) | 0x43000000).to(tl.float32, bitcast=True)
        high = ((shifted & 0x00780000) | 0x43000000).to(tl.float32, bitcast=True)
        x_low = tl.load(x_ptr + first + j).to(tl.float32)
        x_high = tl.load(x_ptr + first + j + 1).to(tl.float32)
        dot += low * (2.0 * x_low)
        dot += high * (0.125 * x_high)
        x_sum += x_low + x_high
        magic += 256.0 * x_low + 16.0 * x_high
    return dot - magic, x_sum


@triton.jit
def _columns_kernel(
    x_ptr,
    words_ptr,
    table_ptr,
    out_ptr,
    N,
    WORDS: tl.constexpr,
    GROUP: tl.constexpr,
    COLUMNS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[c] = the sum over k of ((u - 8) * s + z) * x[k] for the COLUMNS outputs of
    program_id(0), BLOCK words of each a step (the module docstring's layout)."""
    col = tl.program_id(0) * COLUMNS + tl.arange(0, COLUMNS)
    acc = tl.zeros((BLOCK, COLUMNS), dtype=tl.float32)
    for start in range(0, WORDS, BLOCK):
        word = start + tl.arange(0, BLOCK)
        words = tl.load(words_ptr + word[:, None] * N + col[None, :])
        pair = tl.load(table_ptr + (word * 8 // GROUP)[:, None] * N + col[None, :])
        dot, x_sum = _word_sums(words, x_ptr, 8 * word[:, None])
        acc += _scaled(dot, x_sum, pair)
    tl.store(out_ptr + col, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


@triton.jit
def _scaled(dot, x_sum, pair):
    """A word's sum of ((u - 8) * s + z) * x from its sums of u * x and x, and its group's
    (scale, zero) int32."""
    scale = (pair << 16).to(tl.float32, bitcast=True)
    zero = (pair & -65536).to(tl.float32, bitcast=True)
    return scale * (dot - 8.0 * x_sum) + zero * x_sum


def columns(codes: torch.Tensor) -> torch.Tensor:
    """Codes u [out, in] (0 to 15) as the layout's words [in // 8, out]."""
    # Two codes a byte, the first low; four bytes a little-endian int32.
    pairs = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)
    return pairs.view(torch.int32).t().contiguous()


def product(
    x: torch.Tensor, words: torch.Tensor, table: torch.Tensor, point: tuple[int, ...]
) -> torch.Tensor:
    """x [1, in] times the weight in the layout (`table` tinygemm's, as int32 [in // GROUP,
    out]) at a sweep point, transposed: [1, out] in x's dtype."""
    outputs, block, warps = point
    n = words.shape[1]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _columns_kernel[(n // outputs,)](
        x,
        words,
        table,
        out,
        n,
        WORDS=words.shape[0],
        GROUP=GROUP,
        COLUMNS=outputs,
        BLOCK=block,
        num_warps=warps,
    )
    return out


def reference(x: torch.Tensor, codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x times (u - 8) * s + z, in float32."""
    scale, zero = (t.t().float().repeat_interleave(GROUP, 1) for t in table.unbind(-1))
    return x.float() @ ((codes.float() - 8.0) * scale + zero).t()


def timed(shape: str, replays: int) -> list[list[str]]:
    """tinygemm, then the layout's GEMV at the best point of its sweep, for `shape`, each with
    its largest difference from the float32 product."""
    rows, cols = map(int, shape.split("x"))
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32, device="cuda")
    plain = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    tiles = torch.ops.aten._convert_weight_to_int4pack(plain, 8 if cols % 128 == 0 else 4)
    table = (torch.randn(cols // GROUP, rows, 2, device="cuda") * 0.01).bfloat16()
    nbytes = tiles.nbytes + table.nbytes
    copies = int(ROTATED_BYTES / nbytes) + 2
    count = max(copies, 60)
    x = torch.randn(1, cols, device="cuda").bfloat16()
    exact = reference(x, codes, table)

    def rotated(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]

    def each(call: Callable[[int], object]) -> list[Callable[[], object]]:
        return [lambda i=i % copies: call(i) for i in range(count)]

    def row(what: str, us: float, out: torch.Tensor) -> list[str]:
        diff = (out.float().view(1, rows) - exact).abs().max().item()
        mb = nbytes / 1e6
        return [shape, f"{mb:.1f}", what, f"{us:.2f}", f"{mb / us:.2f}", f"{diff:.3g}"]

    tinygemm = rotated(tiles, table)
    call = lambda i: torch.ops.aten._weight_int4pack_mm(x, tinygemm[i][0], GROUP, tinygemm[i][1])  # noqa: E731
    found = [row("tinygemm", graphed_us(each(call), replays), call(0))]
    words = columns(codes)
    table_words = table.view(torch.int32).view(cols // GROUP, rows)
    weights = rotated(words, table_words)
    best: tuple[float, tuple[int, ...]] = (float("inf"), ())
    for point in itertools.product(*SWEEP):
        outputs, block, _ = point
        if rows % outputs or (cols // 8) % block or outputs * block > MOST_WORDS:
            continue
        call = lambda i, p=point: product(x, *weights[i], p)  # noqa: E731
        best = min(best, (graphed_us(each(call), 5), point))
    point = best[1]
    us = graphed_us(each(lambda i: product(x, *weights[i], point)), replays)
    what = f"columns: {point[0]} outputs, {point[1]} words a step, {point[2]} warps"
    found.append(row(what, us, product(x, words, table_words, point)))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    return int4_main(argv, __doc__, "bench/int4_columns.py", SHAPES, GROUP, timed)


if __name__ == "__main__":
    sys.exit(main())
