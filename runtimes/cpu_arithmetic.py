"""What the CPU an artifact runs on computes half precision with, for the report's `target`:
the CPU by name, its features that change half-precision arithmetic, and (for a runtime whose
kernels pick their arithmetic by those features) how its float16 products are summed, measured.

The same float16 artifact computes differently on different CPUs: XNNPACK sums a float16 matrix
product in float16 on a CPU with float16 arithmetic (x86's avx512_fp16, Arm's asimdhp: some
Xeons and most phones) and in float32 elsewhere, where eager PyTorch on the CPU always sums in
float32. A half-precision verdict holds for the arithmetic it was measured on; the report says
which.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

# The CPU flags (Linux's names) that decide how half precision is computed: float16 and
# bfloat16 arithmetic and dot products, and float16 conversion alone (f16c: storage, not math).
HALF_FEATURES = (
    "f16c",
    "avx512_fp16",
    "avx512_bf16",
    "amx_bf16",
    "amx_fp16",
    "fphp",
    "asimdhp",
    "bf16",
)

# A float16 probe's inner dimension: summed in float16, its partial sums reach hundreds of
# units of their last place, and every addition past that rounds; summed in float32, the only
# error is rounding the result to float16, at most half a unit in its last place.
_PROBE_INNER = 4096
_PROBE_OUTPUTS = 64
# Between float32's half a unit and float16 sums' tens to hundreds (161 when sixteen float16
# accumulators are emulated on this probe).
_FLOAT16_SUMS_ULPS = 2.0


def describe_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The CPU by name and its half-precision features ("none" where it has none)."""
    name, flags = platform.processor() or platform.machine(), set()
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model name") and name in ("", platform.machine()):
                name = value.strip()
            elif key in ("flags", "Features"):
                flags.update(value.split())
    present = [feature for feature in HALF_FEATURES if feature in flags]
    return {"cpu": name, "cpu_features": ",".join(present) or "none"}


@functools.cache
def xnnpack_float16_sums() -> str:
    """How XNNPACK sums float16 products on this CPU, measured: one float16 linear layer lowered
    to XNNPACK and run by ExecuTorch's runtime, its error against float64 in units of the last
    place of each output. "float16" or "float32", with the measured error; "not measured" where
    ExecuTorch's lowering is not installed (a runtime-only target)."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner,
        )
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError as error:
        return f"not measured ({error.name} is not installed)"
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(1, _PROBE_INNER, generator=generator).to(torch.float16)
    layer = torch.nn.Linear(_PROBE_INNER, _PROBE_OUTPUTS, bias=False).to(torch.float16).eval()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(_PROBE_OUTPUTS, _PROBE_INNER, generator=generator))
    exported = torch.export.export(layer, (inputs,))
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
    method = Runtime.get().load_program(program.to_executorch().buffer).load_method("forward")
    produced = method.execute([inputs])[0].double()
    exact = inputs.double() @ layer.weight.double().T
    last_place = torch.finfo(torch.float16).eps * torch.exp2(torch.floor(torch.log2(exact.abs())))
    ulps = ((produced - exact).abs() / last_place).max().item()
    summed_in = "float16" if ulps > _FLOAT16_SUMS_ULPS else "float32"
    return f"{summed_in} (a {_PROBE_INNER}-long float16 dot product off by {ulps:.2g} ulp)"
