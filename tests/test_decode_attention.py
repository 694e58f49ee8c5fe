"""backend.decode_attention: the decode step's attention (the cache write, RoPE and SDPA over the
cache) rewritten into the project's Triton kernel (exporter/backends/common/decode_attention.py),
which AOTInductor compiles into a CUDA package. CI has no GPU, so here the kernel runs under
Triton's interpreter on the CPU, in a process of its own (tests/decode_attention_steps.py), and
must compute what the decode step computed without it at every position, splits of the slots
and grouped-query heads included (the tiny Llama has 4 heads over 2 KV heads). The GPU check
runs it compiled (tests/gpu_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporter import config, export, models
from exporter.backends import aoti
from exporter.backends.common import decode_attention
from exporter.errors import ConfigError
from tests.conftest import composed

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# A cache of 512 slots is split over 8 programs a head; the positions reach its last split.
SLOTS = 512
POSITIONS = ("0", "1", "300", "511")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def program(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    """The model's dtype, and its program exported with a static KV cache."""
    overrides = (
        "backend=aoti",
        "model.kv_cache=static",
        "model.num_hidden_layers=1",
        f"model.dtype={request.param}",
        f"model.max_cache_len={SLOTS}",
        "dynamic.seq.max=16",
    )
    job = config.to_job(composed(*overrides))
    out = tmp_path_factory.mktemp(f"decode-attention-{request.param}")
    return request.param, export.run(models.build(job.model, job.dynamic), job.export, out).path


def test_the_kernel_computes_the_decode_steps_attention_at_every_position(
    program: tuple[str, Path],
) -> None:
    dtype, program_file = program
    run = subprocess.run(
        [sys.executable, "-m", "tests.decode_attention_steps", str(program_file), *POSITIONS],
        cwd=PROJECT_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout)
    assert found["rewritten"] == 1
    assert "exporter.decode_attention.default" in found["targets"]
    gone = ("scaled_dot_product_attention", "index_copy_", "neg", "slice")
    assert not [t for t in found["targets"] if any(name in t for name in gone)]
    assert found["argmax_agree"] == len(POSITIONS)
    # q, k and v straight from their projections, RoPE's cos and sin and the mask as the model
    # computes them once for every layer, the slot from the position input.
    reads = ["aten.linear.default"] * 3 + ["aten.to.dtype"] * 2 + ["aten.le.Tensor"]
    assert found["attention_inputs"] == [[*reads, "aten.select.int"]]
    if dtype == "bfloat16":
        # RoPE in float32 rounded once, where the model rounds each product: a step of
        # bfloat16 (2 ** -8 of a value) in a key, and about that in the logits.
        assert found["worst"] < 2e-2
        assert found["cache_max_diff"] <= 2**-7
    else:
        assert found["worst"] < 1e-5
        assert found["cache_max_diff"] < 1e-5


def test_the_programs_prefill_is_left_alone(program: tuple[str, Path]) -> None:
    # Its calls' seq dim is symbolic: no call of one query to rewrite.
    assert decode_attention.rewritten(torch.export.load(program[1])) == 0


@pytest.mark.parametrize(
    ("overrides", "computed"),
    [
        ((), False),
        (("backend.device=cuda",), True),
        (("backend.device=cuda", "backend.decode_attention=false"), False),
    ],
)
def test_the_kernel_is_used_on_cuda_unless_the_config_says(
    overrides: tuple[str, ...], computed: bool
) -> None:
    backend = config.to_job(composed("backend=aoti", *overrides)).backend
    assert aoti.computes_decode_attention(backend) is computed


def test_the_kernel_is_refused_on_the_cpu() -> None:
    job = config.to_job(composed("backend=aoti", "backend.decode_attention=true"))
    with pytest.raises(ConfigError, match=r"backend\.decode_attention=true"):
        aoti.BACKEND.check(job.backend, job.fallback)


@pytest.mark.parametrize(
    ("kept_by_to", "inputs", "from_the_input"),
    [
        ({"dtype": torch.int64}, {"cache_position"}, True),
        ({"dtype": torch.int32}, {"cache_position"}, False),
        ({"device": "meta"}, {"cache_position"}, False),
        ({"dtype": torch.int64}, set(), False),
    ],
    ids=["same-dtype-and-device", "another-dtype", "another-device", "a-mutated-input"],
)
def test_the_slot_is_read_from_the_input_only_where_its_value_is_the_inputs(
    kept_by_to: dict, inputs: set[str], from_the_input: bool
) -> None:
    # transformers' static cache: arange(1) + to(copy_(a layer's buffer, cache_position[0])).
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    buffer, cache_position = graph.placeholder("buffer"), graph.placeholder("cache_position")
    first = graph.call_function(aten.select.int, (cache_position, 0, 0))
    copied = graph.call_function(aten.copy_.default, (buffer, first))
    kept = graph.call_function(aten.to.dtype_layout, (copied,), kept_by_to)
    arange = graph.call_function(aten.arange.default, (1,))
    slot = graph.call_function(aten.add.Tensor, (arange, kept))
    values = {
        buffer: torch.tensor(0),
        cache_position: torch.tensor([5]),
        first: torch.tensor(5),
        copied: torch.tensor(5),
        kept: torch.tensor(5).to(**kept_by_to),
        arange: torch.arange(1),
        slot: torch.tensor([5]),
    }
    for node, value in values.items():
        node.meta["val"] = value
    assert decode_attention._position(slot, inputs) is (first if from_the_input else slot)


@pytest.mark.parametrize(
    ("views", "looked_through"),
    [
        ([(torch.ops.aten.view.default, [3, 2]), (torch.ops.aten.unsqueeze.default, 0)], True),
        ([(torch.ops.aten.view.default, [1, 1, 6]), (torch.ops.aten.transpose.int, 0, 1)], True),
        ([(torch.ops.aten.transpose.int, 0, 1)], False),
        ([(torch.ops.aten.transpose.int, 0, 1), (torch.ops.aten.reshape.default, [6])], False),
        ([(torch.ops.aten.view.default, [6]), (torch.ops.aten.slice.Tensor, 0, 0, 3)], False),
    ],
    ids=["contiguous", "a-size-one-transpose", "a-transpose", "a-reshaped-copy", "fewer-values"],
)
def test_a_view_is_looked_through_only_where_it_holds_its_sources_values_in_order(
    views: list[tuple], looked_through: bool
) -> None:
    # The kernel reads each input as contiguous from its first value: a view handed over as its
    # source must be that source's values, all of them, in the same order.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = value = torch.arange(6.0).view(2, 3)
    node = x
    for target, *args in views:
        node = graph.call_function(target, (node, *args))
        node.meta["val"] = value = target(value, *args)
    assert decode_attention._unviewed(node) is (x if looked_through else node)
