"""Quality in the verdict, apart from fidelity: quantize.budget judges the artifact's own logits
against the float model's, on text where the model has a tokenizer (top-1 there only), on the
validation inputs otherwise; a job that exceeds it fails on quality (exit 1) while fidelity
passes, and report.json, the terminal, the summary, MLflow and the comparison say which. A
KV-cache job measures quality per judged step and on the text, sets the float model's greedy
tokens beside the artifact's, and ranks its layers (quantize.attribution)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from exporter.config import QualityBudget
from exporter.job import verdict as job_verdict
from exporter.quantize.quality import NextToken
from exporter.quantize.verdict import Quality
from exporter.tracking.comparison import JobSummary
from exporter.tracking.comparison.table import rows, text
from tests import gguf_checkpoint
from tests.conftest import CliResult, job_in_process, run_exporter

QUANTIZED = ("quantize=8da4w", "model.num_hidden_layers=1", "dynamic.seq.max=16")


def quality(kld_mean: float, top1: float, on_text: bool = True) -> Quality:
    """A verdict on figures measured on text (or on random token ids), budget 0.1 and 0.8."""
    found = NextToken(27, kld_mean, 2 * kld_mean, 3 * kld_mean, top1, 0.01)
    text = {"source": "the text", "on_text": on_text, "artifact": found.to_json(), "eager": {}}
    return Quality(QualityBudget(max_kld=0.1, min_top1=0.8), found, {}, None, text, None)


def test_each_budget_fails_quality_alone_and_says_which() -> None:
    assert quality(0.1, 0.8).passed
    (kld,) = quality(0.2, 0.9).failures
    assert kld == "mean KL divergence 0.2 nats on the text is above quantize.budget.max_kld=0.1"
    (top1,) = quality(0.01, 0.75).failures
    assert top1 == "top-1 agreement 0.75 on the text is below quantize.budget.min_top1=0.8"
    assert len(quality(0.2, 0.5).failures) == 2
    assert quality(float("nan"), 0.9).failures, "NaN never passes"
    assert quality(0.2, 0.9).verdict().startswith("quality (what quantization costs) fails:")


def test_on_random_token_ids_top1_is_not_judged() -> None:
    # A random-weight model's nearly flat predictions flip on any change: only KLD counts.
    assert quality(0.01, 0.1, on_text=False).passed
    assert "top-1 is judged on text only" in quality(0.01, 0.1, on_text=False).verdict()
    assert len(quality(0.2, 0.1, on_text=False).failures) == 1


@pytest.fixture(scope="module")
def over_budget(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    """The planted case: a budget that 8da4w exceeds, on an artifact that computes what the
    quantized model computes."""
    return run_exporter(
        tmp_path_factory.mktemp("quality"),
        "backend=eager",
        *QUANTIZED,
        "quantize.budget.max_kld=1e-9",
    )


def test_a_scheme_over_the_quality_budget_fails_on_quality_while_fidelity_passes(
    over_budget: CliResult,
) -> None:
    assert over_budget.exit_code == 1, over_budget.output
    assert "FAILED (exit 1) at the validate stage (quality): quality" in over_budget.output
    # No tokenizer: quality is judged on rows of random token ids, as the model is validated.
    assert "on 5 rows of 16 random token ids is above quantize.budget.max_kld=1e-09" in (
        over_budget.output
    )
    report = over_budget.report()
    # Fidelity: the artifact against the quantized model, passed.
    assert report["passed"] is True
    section = report["quality"]
    assert section["passed"] is False
    assert section["failures"][0].startswith("mean KL divergence")
    assert section["artifact"]["kld_mean"] > 1e-9
    # 7 live shapes of seq 1..16: each position of each is measured.
    assert sorted(section["per_case"]) == sorted(
        s["shape"] and f"seq={s['shape']['seq']}" for s in report["shapes"]
    )
    assert section["artifact"]["positions"] == sum(int(k[4:]) for k in section["per_case"])
    assert 0 <= section["artifact"]["top1"] <= 1
    assert section["eager"]["positions"] == section["artifact"]["positions"]
    summary = json.loads((over_budget.run_dir / "summary.json").read_text())
    assert summary["failed_on"] == "quality"
    assert summary["quality_passed"] is False
    # The figures the budget judged: the artifact on the rows of random token ids.
    assert summary["quality_kld_mean"] == section["text"]["artifact"]["kld_mean"]


def test_mlflow_and_the_comparison_carry_quality(over_budget: CliResult) -> None:
    (run,) = over_budget.mlflow_runs()
    tags, metrics = run.data.tags, run.data.metrics
    assert (tags["failed_on"], tags["quality"]) == ("quality", "failed")
    assert metrics["quality.passed"] == 0.0
    assert metrics["quality.kld_mean"] == over_budget.report()["quality"]["artifact"]["kld_mean"]
    assert {
        "quality.top1",
        "quality.kld_p99",
        "quality.prob_drop",
        "quality.eager.kld_mean",
    } <= set(metrics)
    history = MlflowClient(over_budget.tracking_uri).get_metric_history(
        run.info.run_id, "shape.quality.kld_mean"
    )
    assert sorted(m.step for m in history) == [1, 2, 9, 13, 14, 15, 16]
    headers, table = rows([JobSummary.read(over_budget.run_dir)])
    row = dict(zip(headers, table[0], strict=True))
    assert row["failed_on"] == "quality"
    assert row["quality_kld_mean"] == metrics["quality.text.kld_mean"]


def test_a_kv_cache_job_measures_quality_per_step_on_text_beside_float_greedy_and_ranks_layers(
    tmp_path: Path,
) -> None:
    # A checkpoint with a tokenizer (a byte vocabulary): perplexity and greedy text too.
    path = gguf_checkpoint.write(gguf_checkpoint.tiny_llama(), tmp_path / "tiny.F32.gguf")
    record, report = job_in_process(
        tmp_path / "run",
        *gguf_checkpoint.chat_job(path),
        "quantize=8da8w",
        "quantize.attribution=true",
        # Random weights: their nearly flat predictions on text flip on any change
        # (tests/test_quantize_auto.py judges a trained model's top-1).
        "quantize.budget.min_top1=0",
    )
    assert record.error is None, record.error
    section = report["quality"]
    shapes = [e["shape"] for e in report["executions"]]
    judged = [f"session={s['session']},pos={s['pos']},seq={s['seq']}" for s in shapes]
    assert sorted(section["per_case"]) == sorted(judged)
    # The float model's greedy tokens (its float64 oracle's) beside the artifact's, as text.
    greedy = section["greedy"]
    assert greedy["artifact"] == report["greedy"]["artifact"]
    assert len(greedy["float"]) == len(greedy["artifact"]) == 11
    assert greedy["text"]["artifact"] == report["greedy"]["text"]["artifact"]
    # The artifact on 5 rows of the text, each the cache's 32 slots: its perplexity, KLD and
    # top-1 against the float model's, beside the quantized model's in eager.
    on_text = section["text"]
    assert on_text["on_text"] and on_text["source"].startswith("Python's documentation")
    found = on_text["artifact"]
    assert found["positions"] == on_text["eager"]["positions"] == 5 * 32
    ratio = found["perplexity"] / found["perplexity_float"]
    assert found["perplexity_ratio"] == pytest.approx(ratio)
    assert 1 < found["perplexity_float"] < 1000
    assert found["kld_mean"] == pytest.approx(on_text["eager"]["kld_mean"], rel=0.5)
    # Two decoder layers' 7 linear layers and the output projection, each quantized alone.
    layers = report["attribution"]["layers"]
    assert len(layers) == 15
    kld = [layer["kld_mean"] for layer in layers]
    assert kld == sorted(kld, reverse=True) and kld[0] > 0
    worst = [layer["name"] for layer in layers[:5]]
    assert report["attribution"]["override"] == f"quantize.skip=[{','.join(worst)}]"
    assert record.attribution is not None and record.attribution.worst_names() == worst
    # The closing lines: quality's figures, the float model's greedy answer beside the
    # artifact's, and the override that keeps the costliest layers float.
    record.ended_ms = record.started_ms + 1000
    summary = JobSummary.of(record, {})
    closing = "\n".join(job_verdict.lines(summary, 0, tmp_path, [], [], 1.0))
    assert f"quality vs float: KLD {found['kld_mean']:.3g}" in closing
    assert f"artifact {greedy['text']['artifact']!r}" in closing
    assert f"(quantize.attribution): quantize.skip=[{','.join(worst)}]" in closing


def test_the_terminal_table_shows_kld_only_for_a_sweep_that_quantized() -> None:
    float_job = JobSummary("0-llama-eager", {"quantize": "none"}, "passed", 0)
    quantized_job = JobSummary("1-llama-eager", {"quantize": "8da4w"}, "passed", 0)
    quantized_job.quality_kld_mean = 0.0123
    assert "KLD" not in text([float_job]).splitlines()[0].split()
    header, _, _, row = text([float_job, quantized_job]).splitlines()
    assert header.split()[3:6] == ["stage", "ratio", "KLD"]
    assert row.split() == ["1-llama-eager", "8da4w", "passed", "0.0123"]
    assert row.index("0.0123") == header.index("KLD")
