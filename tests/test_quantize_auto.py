"""quantize=auto and the quality budget, on a model whose predictions mean something: a tiny
Llama trained on the quality text (tests/trained_llama.py), with outlier weight columns planted
so that 4-bit groups lose much on the layers that read them.

The default budget fails a scheme that agrees with the float model on about half the text's next
tokens and passes one within it; quantize=auto meets the budget at fewer bytes than the best
uniform recipe that meets it, says its plan, and keeps it in the cache; a GGUF file's own codes go
through AOTInductor's package and are judged there."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from exporter import models
from exporter.config import DimBounds, HfConfig, KvCache, QualityBudget
from exporter.job import verdict as job_verdict
from exporter.quantize import plan, quality, recipes
from exporter.tracking.comparison import JobSummary
from tests import gguf_checkpoint, trained_llama
from tests.conftest import job_in_process, run_exporter
from tests.test_cli import assert_user_error

# What every job of this file runs: a KV cache of 128 slots, rows of 128 tokens of text.
CACHED = ("backend=eager", "model=hf", "model.kv_cache=static")
# The planted columns' factor: 8da4w then agrees with the float model on about half the tokens.
OUTLIERS = 30.0


@pytest.fixture(scope="module")
def trained() -> torch.nn.Module:
    return trained_llama.trained()


@pytest.fixture(scope="module")
def planted(trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained model with outlier columns, as a float32 GGUF file."""
    model = trained_llama.with_outlier_columns(copy.deepcopy(trained), OUTLIERS)
    return gguf_checkpoint.write(model, tmp_path_factory.mktemp("planted") / "planted.F32.gguf")


@pytest.fixture(scope="module")
def quantized_file(trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained model as llama.cpp's quantizer writes it: 4-bit with minimums (Q4_1) for
    every linear layer of the first block, 8-bit (Q8_0) for the second's."""
    types = {
        f"blk.{layer}.{name}.weight": kind
        for layer, kind in ((0, "Q4_1"), (1, "Q8_0"))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    }
    path = tmp_path_factory.mktemp("quantized") / "trained.Q4_1.gguf"
    return gguf_checkpoint.write(trained, path, types)


def test_the_default_budget_fails_a_scheme_that_agrees_on_half_the_next_tokens(
    planted: Path, tmp_path: Path
) -> None:
    result = run_exporter(
        tmp_path, *CACHED, f"model.checkpoint={planted}", "quantize=8da4w", "mlflow=off"
    )
    assert_user_error(result, 1, "FAILED (exit 1) at the validate stage (quality)")
    section = result.report()["quality"]
    assert result.report()["passed"] is True, "fidelity: the artifact computes the model"
    text = section["text"]
    assert text["on_text"] and text["source"].startswith("Python's documentation")
    # 5 rows of 128 tokens, each a session of its own: a prefill of 64, then 64 decode steps.
    assert text["artifact"]["positions"] == 5 * 128
    assert 0.4 < text["artifact"]["top1"] < 0.7, text["artifact"]
    assert text["artifact"]["kld_mean"] > 0.5
    assert text["artifact"]["perplexity_ratio"] > 1.5
    assert [f.split(" on ")[0] for f in section["failures"]] == [
        f"mean KL divergence {text['artifact']['kld_mean']:.3g} nats",
        f"top-1 agreement {text['artifact']['top1']:.3g}",
    ]


def test_a_scheme_within_the_default_budget_passes(trained, tmp_path: Path) -> None:
    path = gguf_checkpoint.write(trained, tmp_path / "trained.F32.gguf")
    record, report = job_in_process(
        tmp_path / "run", *CACHED, f"model.checkpoint={path}", "quantize=8da8w"
    )
    assert record.error is None, record.error
    text = report["quality"]["text"]["artifact"]
    assert text["top1"] > 0.95 and text["kld_mean"] < 0.01
    assert report["quality"]["passed"]


def test_auto_meets_the_budget_at_fewer_bytes_than_the_best_uniform_recipe(
    planted: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    overrides = (*CACHED, f"model.checkpoint={planted}", "quantize=auto")
    record, report = job_in_process(tmp_path / "run", *overrides, cache_dir=cache)
    assert record.error is None, record.error
    found = plan.Plan.from_json(json.loads((tmp_path / "run" / "plan.json").read_text()))
    assert found.within_budget
    # The artifact on the text, as the verdict judges it, within the default budget too.
    text = report["quality"]["text"]["artifact"]
    assert text["top1"] >= 0.9 and text["kld_mean"] <= 0.05
    recipe_of = found.recipe_of()
    # The layers that read the planted columns need more than 4 bits; the others do not.
    assert {recipe_of[f"model.model.layers.{i}.mlp.down_proj"] for i in (0, 1)} <= {
        "int4",
        "int4_g128",
    }
    assert "int8" in {recipe_of[f"model.model.layers.{i}.mlp.gate_proj"] for i in (0, 1)}
    # Against each uniform recipe, measured here on the same text: int4 misses the budget,
    # int8 meets it with more bytes than the plan.
    bundle = _bundle(planted)
    units = plan.units(bundle.module, ("int4", "int8", "float"), {}, skip=())
    assert len(units) == len(found.choices) == 14
    text_rows, on_text = quality.eval_rows(bundle, None, seed=0)
    measure = plan.Measure(bundle.module, quality.logits_runner(bundle), text_rows.rows)
    budget = QualityBudget()
    uniform = {}
    for name in ("int4", "int8"):
        recipe = recipes.RECIPES[name]
        quality_of = measure({unit: recipe for unit in units})
        uniform[name] = (
            plan.within(quality_of, budget, on_text),
            sum(recipe.nbytes(unit.layer, unit.logits) for unit in units),
        )
    assert uniform["int4"][0] is False and uniform["int8"][0] is True
    planned_bytes = sum(choice.bytes for choice in found.choices)
    assert planned_bytes < uniform["int8"][1]
    assert report["quantization"]["plan"]["within_budget"] is True
    # The closing lines give the plan in a line, beside the quality the budget judged.
    record.ended_ms = record.started_ms + 1000
    closing = "\n".join(job_verdict.lines(JobSummary.of(record, {}), 0, tmp_path, [], [], 1.0))
    assert f"[job] {found.summary()}" in closing
    assert found.summary().startswith(f"plan: {planned_bytes / 1e6:.1f} MB of weights, int")
    # A second job takes the plan from the cache: nothing measured again.
    record, _ = job_in_process(tmp_path / "again", *overrides, cache_dir=cache)
    assert record.cache.hits["plan"] is True


def test_a_gguf_files_codes_go_through_aotinductor_and_are_judged_there(
    quantized_file: Path, tmp_path: Path
) -> None:
    record, report = job_in_process(
        tmp_path / "run",
        *CACHED,
        "backend=aoti",
        f"model.checkpoint={quantized_file}",
        "quantize=auto",
    )
    assert record.error is None, record.error
    assert report["passed"]
    by_recipe = report["quantization"]["plan"]["by_recipe"]
    assert by_recipe["int4 from file Q4_1"]["layers"] == 7
    assert by_recipe["int8 from file Q8_0"]["layers"] == 7
    # The package's packed weights and bfloat16 scales are the quantized model's, bit for bit.
    audit = record.weights_audit
    assert audit is not None and audit.passed
    checked = {found.parameter for found in audit.checked}
    assert {f"model.model.layers.{i}.mlp.down_proj.planes.0.packed" for i in (0, 1)} <= checked
    assert "model.model.layers.1.mlp.down_proj.planes.1.scales_and_zeros" in checked
    text = report["quality"]["text"]["artifact"]
    assert text["top1"] > 0.95 and text["kld_mean"] < 0.01


def test_a_planned_output_projection_and_embedding_compile_and_pass_through_aotinductor(
    tmp_path: Path,
) -> None:
    """The default Llama (random weights, no tokenizer: judged on random token ids): its output
    projection packed, its largest logits ranked exactly (top-k, a lookup of rows, a scatter in
    the program), its untied embedding looking rows up in a packed table of its own."""
    record, report = job_in_process(
        tmp_path / "run", "backend=aoti", "model.kv_cache=static", "quantize=auto"
    )
    assert record.error is None, record.error
    assert report["passed"] and report["quality"]["passed"]
    recipe_of = {c["layer"]: c["recipe"] for c in report["quantization"]["plan"]["choices"]}
    assert recipe_of["model.lm_head"].startswith("int") and recipe_of["model.model.embed_tokens"]
    checked = {found.parameter for found in record.weights_audit.checked}
    assert {"model.lm_head.exact_scale", "model.lm_head.exact_offset"} <= checked
    assert "model.model.embed_tokens.table.planes.0.packed" in checked
    assert report["quality"]["text"]["source"] == "5 rows of 128 random token ids"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (("backend=webgpu",), "quantize=auto: backend=webgpu runs quantize=none only"),
        (
            ("backend=aoti", "quantize.embedding=int8"),
            "quantize.embedding: quantize=auto plans the token embedding",
        ),
        (("quantize.eval_text=/no/such.txt",), "quantize.eval_text=/no/such.txt: no such file"),
        (("quantize.budget.min_top1=2",), "quantize.budget.min_top1 is 2.0; it must be between"),
    ],
)
def test_quantize_auto_refuses_what_it_cannot_do_before_any_work(
    tmp_path: Path, overrides: tuple[str, ...], named: str
) -> None:
    result = run_exporter(tmp_path, "quantize=auto", *overrides, "mlflow=off")
    assert_user_error(result, 2, named)


def _bundle(path: Path) -> models.ModelBundle:
    cfg = HfConfig(name="hf", checkpoint=str(path), kv_cache=KvCache.static, max_cache_len=128)
    return models.build(cfg, {"seq": DimBounds(min=1, max=128)})
