"""The CPU int4 kernel's packing differs between CPUs (blocks of 64 rows on AVX512, 32 on AVX2
and without vector instructions, in two byte layouts): runtimes/int4_kernels.py reads this
machine's from the kernel itself, and every reader of packed codes (the packed layers' lookups
and dequantization, the repacking into CUDA's tiles, the weights audit) follows it. Here on this
machine's packing, and in fresh processes on the other packings its CPU can run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from runtimes import int4_kernels

# PyTorch's own description of each (aten/src/ATen/native/cpu/int4mm_kernel.cpp): the block,
# and whether a byte holds rows j and j + block // 2 (True) or 2j and 2j + 1 (False).
DOCUMENTED = {"AVX512": (64, True), "AVX2": (32, True), "DEFAULT": (32, False)}
SHAPES = [(64, 32), (128, 96), (192, 256)]


def _codes(rows: int, cols: int) -> torch.Tensor:
    torch.manual_seed(rows * cols)
    return torch.randint(0, 16, (rows, cols), dtype=torch.int32)


@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_the_codes_the_kernel_packed_are_read_back_every_row_and_some(rows: int, cols: int):
    codes = _codes(rows, cols)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(int4_kernels.codes_of(packed).to(torch.int32), codes)
    some = torch.tensor([rows - 1, 0, rows // 2 + 1, 17])
    assert torch.equal(int4_kernels.codes_of(packed, some).to(torch.int32), codes[some])


def test_this_machines_packing_is_the_one_pytorch_documents_for_its_cpu() -> None:
    packing = int4_kernels.cpu_packing()
    assert packing.name == torch.backends.cpu.get_cpu_capability()
    assert (packing.block, packing.halves) == DOCUMENTED[packing.name]


_CHILD = """
import json, torch
from runtimes import int4_kernels
codes = torch.randint(0, 16, (192, 256), dtype=torch.int32)
packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
tiles = int4_kernels.for_cuda(packed)
packing = int4_kernels.cpu_packing()
print(json.dumps({
    "packing": [packing.name, packing.block, packing.halves],
    "read": torch.equal(int4_kernels.codes_of(packed).to(torch.int32), codes),
    "round_trip": torch.equal(int4_kernels.from_cuda(tiles, 192, 256), packed),
}))
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_another_packing_this_cpu_runs_is_read_and_repacked_alike(capability: str) -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.splitlines()[-1])
    name, block, halves = found["packing"]
    # A CPU without AVX2 runs the packing without vectors instead.
    assert name in (capability.upper(), "DEFAULT")
    assert (block, halves) == DOCUMENTED[name]
    assert found["read"] and found["round_trip"]
