"""bench/projection_fusion.py, which bench/aoti_options.py measures on a GPU: projections that
read the same input become one matmul (q/k/v and gate/up of each layer, bfloat16's linear
layers and the int4 kernel's calls alike), their weights one buffer, and the program computes
what it did."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from bench.projection_fusion import fused_projections
from exporter import config, export, models, quantize
from tests.conftest import composed

TWO_LAYERS = ("model=llama", "model.kv_cache=static", "model.num_key_value_heads=4")
LINEAR = "aten.linear.default"
INT4 = "aten._weight_int4pack_mm_for_cpu.default"


def _calls(program: torch.export.ExportedProgram) -> collections.Counter:
    return collections.Counter(
        str(node.target) for node in program.graph.nodes if str(node.target) in (LINEAR, INT4)
    )


@pytest.mark.parametrize(
    ("overrides", "kernel"),
    [((), LINEAR), (("model.dtype=bfloat16", "backend=aoti", "quantize=int4_weight"), INT4)],
)
def test_each_layers_projections_of_one_input_become_one_matmul_computing_the_same(
    tmp_path: Path, overrides: tuple[str, ...], kernel: str
) -> None:
    job = config.to_job(composed(*TWO_LAYERS, *overrides))
    bundle = models.build(job.model, job.dynamic)
    if job.quantize.enabled:
        bundle = quantize.quantized(bundle, job.quantize, None, job.backend.int4_weight_packed)
    program = export.run(bundle, job.export, tmp_path).program
    fused = fused_projections(program)
    # Per layer, q/k/v three calls to one and gate/up two to one; o, down and the head stay.
    assert _calls(program)[kernel] == 15 and _calls(fused)[kernel] == 9
    # The fused layers' own weights left the program: one buffer (and one table of scales and
    # zeros for int4) per set in their place.
    per_weight = 2 if kernel == INT4 else 1
    assert len(program.state_dict) - len(fused.state_dict) == 2 * (5 - 2) * per_weight
    tokens, positions = torch.tensor([[3, 5, 7]]), torch.arange(3)
    got, want = fused.module()(tokens, positions), program.module()(tokens, positions)
    # A wider matmul may sum in another order on another CPU (equal on this AMD one): a few
    # roundings of the output's dtype, where a wrong split would be wrong by the whole output.
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 4 * torch.finfo(want.dtype).eps * scale
