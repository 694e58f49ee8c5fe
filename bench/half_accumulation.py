"""Where a half-precision artifact of backend=executorch loses precision against eager PyTorch
at the same dtype, both judged against float64 on the same half-precision weights and inputs:

1. one nn.Linear at float16 and bfloat16, for inner dimensions K from 64 to 2048. A product
   that sums in float32 and rounds once is off by one rounding of its output, whatever K; one
   that sums in half precision rounds every partial sum, and its error grows like sqrt(K)
   times that rounding (`sqrt(K)*u`, u = 2^-11 for float16, is that growth as a yardstick).
   `delegated` says whether XNNPACK took the layer (it takes no bfloat16 linear: ExecuTorch's
   portable kernel runs it).
2. one causal-free scaled_dot_product_attention at float16 (4 heads of 64), lowered as the
   backend lowers it (exporter/backends/common/xnnpack_rewrites.py makes it bmm, softmax, bmm) and
   without that rewrite, for scores of growing spread; `eager, f16 scores` is eager PyTorch
   computing the same three steps with the scores and weights rounded to float16 between them.

    python bench/half_accumulation.py
    python bench/half_accumulation.py --dims 64 256 1024 --rows 32
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from tabulate import tabulate

from exporter.backends.common.xnnpack_rewrites import ViewsForXnnpack, for_xnnpack

OUT_FEATURES = 256


def nrmse(actual: torch.Tensor, golden: torch.Tensor) -> float:
    """RMS error over the golden's RMS."""
    error = (actual.to(torch.float64) - golden).square().mean().sqrt()
    return (error / golden.square().mean().sqrt()).item()


class Attention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def lowered(
    module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], folder: Path, rewrite: bool = False
) -> tuple[torch.Tensor, bool]:
    """The module's output from its .pte, and whether XNNPACK took any of it; `rewrite` first
    applies the backend's own rewrites, as backend=executorch does."""
    program = torch.export.export(module, inputs)
    if rewrite:
        program = for_xnnpack(program)
    edge = to_edge_transform_and_lower(
        program, transform_passes=[ViewsForXnnpack()], partitioner=[XnnpackPartitioner()]
    )
    delegated = any(
        node.op == "call_function" and "executorch_call_delegate" in str(node.target)
        for node in edge.exported_program().graph.nodes
    )
    path = folder / "linear.pte"
    path.write_bytes(edge.to_executorch().buffer)
    method = Runtime.get().load_program(path).load_method("forward")
    return method.execute(list(inputs))[0].clone(), delegated


def measure(dtype: torch.dtype, inner: int, rows: int, folder: Path) -> list[object]:
    generator = torch.Generator().manual_seed(inner)
    layer = torch.nn.Linear(inner, OUT_FEATURES, bias=False).to(dtype).eval()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(OUT_FEATURES, inner, generator=generator) / math.sqrt(inner))
    x = torch.randn(rows, inner, generator=generator).to(dtype)
    golden = x.to(torch.float64) @ layer.weight.to(torch.float64).T
    with torch.no_grad():
        eager = layer(x)
    artifact, delegated = lowered(layer, (x,), folder)
    unit = 2.0**-11
    return [
        str(dtype).removeprefix("torch."),
        inner,
        delegated,
        f"{nrmse(artifact, golden):.3g}",
        f"{nrmse(eager, golden):.3g}",
        f"{nrmse(artifact, golden) / nrmse(eager, golden):.2f}",
        f"{math.sqrt(inner) * unit:.3g}",
    ]


def measure_attention(seq: int, spread: float, rewrite: bool, folder: Path) -> list[object]:
    """Query and key scaled by `spread`, so the scores' standard deviation grows with its
    square (a trained model's reach 10 and more)."""
    generator = torch.Generator().manual_seed(seq)
    scales = (spread, spread, 1.0)
    q, k, v = (
        (torch.randn(1, 4, seq, 64, generator=generator) * scale).to(torch.float16)
        for scale in scales
    )
    wide = [t.to(torch.float64) for t in (q, k, v)]
    golden = torch.nn.functional.scaled_dot_product_attention(*wide)
    eager = Attention()(q, k, v)
    scores = (q.float() / 8 @ k.float().transpose(-1, -2)).half()
    stepwise = torch.softmax(scores, dim=-1) @ v
    artifact, _ = lowered(Attention(), (q, k, v), folder, rewrite)
    spread_of_scores = (wide[0] / 8 @ wide[1].transpose(-1, -2)).std().item()
    return [
        seq,
        rewrite,
        f"{spread_of_scores:.1f}",
        f"{nrmse(artifact, golden):.3g}",
        f"{nrmse(eager, golden):.3g}",
        f"{nrmse(stepwise, golden):.3g}",
        f"{nrmse(artifact, golden) / nrmse(eager, golden):.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    rows, attention = [], []
    with tempfile.TemporaryDirectory() as folder:
        for dtype in (torch.float16, torch.bfloat16):
            for inner in args.dims:
                rows.append(measure(dtype, inner, args.rows, Path(folder)))
        for seq in (16, 128):
            for spread in (1.0, 2.0, 3.0):
                attention.append(measure_attention(seq, spread, True, Path(folder)))
        attention.append(measure_attention(128, 3.0, False, Path(folder)))
    headers = ["dtype", "K", "delegated", "artifact nrmse", "eager nrmse", "ratio", "sqrt(K)*u"]
    print(tabulate(rows, headers=headers))
    print()
    headers = ["seq", "rewritten", "scores std", "artifact nrmse", "eager nrmse"]
    headers += ["eager, f16 scores", "ratio"]
    print(tabulate(attention, headers=headers))


if __name__ == "__main__":
    main()
