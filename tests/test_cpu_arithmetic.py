"""How the CPU an artifact runs on computes half precision, as the report's `target` says it:
the CPU's features read from Linux's cpuinfo (an Intel Xeon with float16 arithmetic, an AMD EPYC
without, an Arm core with it), and XNNPACK's float16 sums measured on this machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtimes.cpu_arithmetic import describe_cpu, xnnpack_float16_sums

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 f16c fma avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse2 avx2 f16c fma avx512f avx512_bf16
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes fphp asimdhp cpuid bf16 i8mm
"""


@pytest.mark.parametrize(
    ("cpuinfo", "features"),
    [
        (XEON, "f16c,avx512_fp16,avx512_bf16,amx_bf16"),
        (EPYC, "f16c,avx512_bf16"),
        (ARM, "fphp,asimdhp,bf16"),
        ("processor\t: 0\nflags\t\t: fpu sse2\n", "none"),
    ],
)
def test_the_cpu_is_described_by_its_half_precision_features(
    tmp_path: Path, cpuinfo: str, features: str
) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    described = describe_cpu(path)
    assert described["cpu_features"] == features
    name = re.search(r"model name\t: (.+)", cpuinfo)
    if name:
        assert described["cpu"] == name.group(1)


def test_xnnpack_sums_float16_as_this_cpu_allows_and_says_by_how_much() -> None:
    measured = xnnpack_float16_sums()
    summed_in, error = re.fullmatch(
        r"(float16|float32) \(a 4096-long float16 dot product off by (\S+) ulp\)", measured
    ).groups()
    features = describe_cpu()["cpu_features"].split(",")
    if not {"avx512_fp16", "asimdhp"} & set(features):
        # Without float16 arithmetic, XNNPACK converts to float32 and sums there: the only
        # error is the result's rounding to float16.
        assert summed_in == "float32"
        assert float(error) <= 0.5 + 1e-6
    else:
        # With it, either sum: the probe tells them apart by far more than its threshold (2).
        assert float(error) <= 0.5 + 1e-6 or float(error) > 8
