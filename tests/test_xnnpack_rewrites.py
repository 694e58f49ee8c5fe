"""The program rewritten for XNNPACK (exporter/backends/common/xnnpack_rewrites.py): the same
outputs as the exported program, transformers' Llama in one delegate, and masks that are not
causal left to the standard lowering."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.export import Dim

from exporter import backends, config, export, models
from exporter.backends.common.xnnpack_rewrites import for_xnnpack
from exporter.config import DimBounds, ExportConfig, ModelDtype
from exporter.export import Exported
from runtimes.loaders import executorch as executorch_runtime
from tests.conftest import CONF_DIR
from tests.test_models import small_llama

SEQ = {"seq": DimBounds(min=1, max=24)}
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def exported_llama(out_dir: Path, **overrides: object) -> tuple[models.ModelBundle, Exported]:
    bundle = models.build(small_llama(**overrides), SEQ)
    return bundle, export.run(bundle, ExportConfig(), out_dir)


def calls(program: torch.export.ExportedProgram, target: object) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and n.target == target)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[models.ModelBundle, Exported]:
    return exported_llama(tmp_path_factory.mktemp("llama"))


def test_the_rewritten_llama_computes_the_programs_logits(llama) -> None:
    bundle, exported = llama
    rewritten = for_xnnpack(exported.program)
    assert calls(exported.program, SDPA) == 1
    assert calls(rewritten, SDPA) == 0
    # transformers' mask ops (cumsum of positions, index, comparisons) are gone.
    for op in (torch.ops.aten.cumsum.default, torch.ops.aten.index.Tensor):
        assert calls(exported.program, op) > 0
        assert calls(rewritten, op) == 0
    original, changed = exported.program.module(), rewritten.module()
    for seq in (1, 2, 13, 24):
        (tokens,) = bundle.make_inputs({"seq": seq}, seq)
        expected = original(tokens)
        torch.testing.assert_close(changed(tokens), expected, rtol=1e-5, atol=1e-6)


def test_llama_lowers_into_one_xnnpack_delegate_and_validates(llama, tmp_path: Path) -> None:
    bundle, exported = llama
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        job = config.to_job(compose("config", overrides=["backend=executorch"]))
    artifact = backends.configured(job).lower(exported, tmp_path)
    partition = artifact.partition
    assert partition.delegates == 1
    # Left on the CPU: the embedding lookup and the positions (arange, their cast to float).
    outside = {n.op for n in partition.nodes if n.placement == "cpu"}
    assert "aten.embedding.default" in outside
    assert outside <= {
        "aten.embedding.default",
        "aten.arange.start_step",
        "aten.add.Tensor",
        "aten.view_copy.default",
        "aten.unsqueeze_copy.default",
        "dim_order_ops._to_dim_order_copy.default",
    }
    assert partition.delegated_fraction > 0.9
    program = executorch_runtime.load(artifact.path, "cpu")
    for seq in (1, 7, 24):
        (tokens,) = bundle.make_inputs({"seq": seq}, seq)
        with torch.no_grad():
            expected = bundle.module(tokens)
        (logits,) = program.run([tokens])
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_a_bfloat16_llamas_attention_is_left_to_the_standard_lowering(tmp_path: Path) -> None:
    _, exported = exported_llama(tmp_path, dtype=ModelDtype.bfloat16)
    rewritten = for_xnnpack(exported.program)
    assert calls(rewritten, SDPA) == calls(exported.program, SDPA) == 1


class WindowedAttention(torch.nn.Module):
    """Attention under a mask built from the positions: causal, and within `window` of the
    query where a window is given."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[2])
        mask = positions[None, :] <= positions[:, None]
        if self.window is not None:
            mask = mask & (positions[:, None] - positions[None, :] < self.window)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)


@pytest.mark.parametrize(("window", "rewritten"), [(None, True), (40, True), (5, False)])
def test_only_a_mask_that_is_causal_at_every_seq_becomes_the_additive_causal_mask(
    window: int | None, rewritten: bool
) -> None:
    # A window wider than every seq the program takes is the causal mask there; a narrower one
    # is not, and its attention keeps the standard lowering.
    module = WindowedAttention(window)
    example = torch.randn(1, 2, 32, 8)
    program = torch.export.export(
        module, (example,), dynamic_shapes=({2: Dim("seq", min=1, max=32)},)
    )
    result = for_xnnpack(program)
    assert calls(result, SDPA) == (0 if rewritten else 1)
    for seq in (1, 6, 32):
        x = torch.randn(1, 2, seq, 8)
        torch.testing.assert_close(result.module()(x), module(x), rtol=1e-5, atol=1e-6)


class RotateHalf(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_rotate_half_becomes_a_linear_layer_with_the_same_values() -> None:
    program = torch.export.export(
        RotateHalf(), (torch.randn(1, 3, 9, 16),), dynamic_shapes=({2: Dim("seq", max=64)},)
    )
    result = for_xnnpack(program)
    assert calls(result, torch.ops.aten.slice.Tensor) == 0
    assert calls(result, torch.ops.aten.linear.default) == 1
    x = torch.randn(1, 3, 40, 16)
    assert torch.equal(result.module()(x), RotateHalf()(x))


def test_an_input_named_after_a_python_builtin_keeps_its_place_in_the_signature() -> None:
    class Scaled(torch.nn.Module):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return input * 2

    program = torch.export.export(Scaled(), (torch.randn(3, 4),))
    rewritten = for_xnnpack(program)
    x = torch.randn(3, 4)
    torch.testing.assert_close(rewritten.module()(x), x * 2)
