"""A static KV cache in ExecuTorch's LLM ops (backend=executorch, backend.llm_ops=custom, the
default): the .pte writes the cache with llama::update_cache and attends with llama::custom_sdpa,
a call each per layer, passes every session to the cache's last slot, and says so to LLM
runners; backend.llm_ops=plain keeps transformers' ops; a model the ops do not fit keeps them
too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime

from exporter import backends, export, models
from exporter.cache import keys
from exporter.config import DimBounds, KvCache, LlmOps
from exporter.export import Exported
from exporter.localize.node_values import node_values
from exporter.models.causal_lm import LlmOpsCacheLM
from exporter.tracking.record import JobRecord
from runtimes import load
from runtimes.loaders.executorch import operator_calls
from runtimes.verdict.sessions import Cache
from tests.test_audit import composed
from tests.test_hf_models import ARCHITECTURES, hf
from tests.test_kv_cache import SMALL
from tests.test_localize import job_in_process

UPDATE_CACHE, CUSTOM_SDPA = "llama::update_cache.out", "llama::custom_sdpa.out"


def lowered(out_dir: Path, *overrides: str) -> Path:
    """The small model's .pte, built with the ops the job's backend asks for."""
    job = composed("backend=executorch", *SMALL, *overrides)
    backend = backends.configured(job)
    bundle = models.build(job.model, job.dynamic, backend.llm_ops)
    exported = export.run(bundle, job.export, out_dir)
    return backend.lower(exported, out_dir).path


@pytest.fixture(scope="module")
def two_layer_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, JobRecord, dict]:
    """A job of the small model with two layers and the LLM ops, in this process: its run dir
    (with its .pte), record and report. One lowering serves the tests of the .pte and of the
    sessions."""
    run_dir = tmp_path_factory.mktemp("llm_ops")
    record, report = job_in_process(
        run_dir, "backend=executorch", *SMALL, "model.num_hidden_layers=2"
    )
    return run_dir, record, report


def test_each_layer_writes_keys_and_values_with_update_cache_and_attends_with_custom_sdpa(
    two_layer_job: tuple[Path, JobRecord, dict],
) -> None:
    run_dir, _, _ = two_layer_job
    pte = run_dir / "model.pte"
    calls = operator_calls(pte)
    # Per layer: one write of its keys, one of its values, one attention over the cache.
    assert calls[UPDATE_CACHE] == 4
    assert calls[CUSTOM_SDPA] == 2
    # transformers' index_copy_ writes, aten::index_put in the .pte, are gone.
    assert "aten::index_put.out" not in calls
    program = Runtime.get().load_program(pte)
    assert list(program.load_method("use_sdpa_with_kv_cache").execute([])) == [True]


def test_llm_ops_plain_keeps_transformers_cache_writes(tmp_path: Path) -> None:
    calls = operator_calls(lowered(tmp_path, "backend.llm_ops=plain"))
    assert calls[UPDATE_CACHE] == calls[CUSTOM_SDPA] == 0
    # The keys' and values' writes (index_copy_, index_put in the .pte) of its one layer.
    assert calls["aten::index_put.out"] == 2


def test_sessions_to_the_last_slot_pass_with_the_llm_ops(
    two_layer_job: tuple[Path, JobRecord, dict],
) -> None:
    _, record, report = two_layer_job
    assert record.error is None
    steps = [e["shape"] for e in report["executions"]]
    assert {s["session"] for s in steps if s["pos"] == 15} == {0, 1}
    assert all(e["passed"] for e in report["executions"])
    ratios = [o["ratio"] for e in report["executions"] for o in e["outputs"]]
    assert max(ratios) < 5
    assert report["greedy"]["artifact_parts_from_oracle_at"] is None


def test_the_oracle_keeps_transformers_attention_while_the_cache_uses_the_ops() -> None:
    job = composed("backend=executorch", *SMALL)
    bundle = models.build(job.model, job.dynamic, LlmOps.custom)
    assert isinstance(bundle.module, LlmOpsCacheLM)
    assert bundle.decoder is not None and bundle.decoder.llm_ops
    tokens = torch.arange(5).unsqueeze(0)
    with torch.no_grad():
        cached = bundle.module(tokens, torch.arange(5))
        uncached = bundle.decoder.uncached(tokens)
    assert bundle.module.model.config._attn_implementation == "sdpa"
    assert torch.allclose(cached, uncached, atol=1e-5)


def test_a_model_the_ops_do_not_fit_keeps_transformers_ops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Gemma2 softcaps its scores in transformers' eager attention, which custom_sdpa does not.
    gemma2 = ARCHITECTURES["gemma2"]
    torch.manual_seed(0)
    gemma2.model(gemma2.config(**gemma2.fields)).save_pretrained(tmp_path)
    bundle = models.build(
        hf(tmp_path, kv_cache=KvCache.static), {"seq": DimBounds(1, 16)}, LlmOps.custom
    )
    assert bundle.decoder is not None and not bundle.decoder.llm_ops
    assert not isinstance(bundle.module, LlmOpsCacheLM)
    assert "ExecuTorch's LLM ops do not fit Gemma2ForCausalLM: its attention is" in caplog.text


def test_the_ops_are_part_of_the_models_cache_key() -> None:
    custom = keys.model(composed("backend=executorch", *SMALL))
    plain = keys.model(composed("backend=executorch", "backend.llm_ops=plain", *SMALL))
    eager = keys.model(composed("backend=eager", *SMALL))
    assert custom["llm_ops"] == "custom"
    # An eager job builds the same module as a plain executorch job: their goldens are shared.
    assert custom != plain == eager


@pytest.fixture(scope="module")
def exported_with_llm_ops(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The small model's exported program with the LLM ops, which two tests read."""
    job = composed("backend=executorch", *SMALL)
    bundle = models.build(job.model, job.dynamic, LlmOps.custom)
    return export.run(bundle, job.export, tmp_path_factory.mktemp("exported"))


def test_the_search_runs_the_llm_ops_in_float64(exported_with_llm_ops: Exported) -> None:
    # Their kernels take float32 and the halves: the float64 run of a node (the search's
    # oracle of it) runs their stand-ins, which agree with the model's own float32 values.
    program = exported_with_llm_ops.program
    ops = [n.name for n in program.graph.nodes if str(n.target).startswith("llama.")]
    assert len(ops) == 3
    values = node_values(program, (torch.arange(9).unsqueeze(0), torch.arange(9)), ops)
    (wide, narrow) = values[next(n for n in ops if "custom_sdpa" in n)]
    assert wide.dtype == torch.float64 and narrow.dtype == torch.float32
    assert torch.allclose(wide, narrow.double(), atol=1e-5)


def test_the_eager_program_decodes_at_the_last_slot(exported_with_llm_ops: Exported) -> None:
    # Export's reasoning (a dynamic length of 2 or more) would otherwise assert in the eager
    # program that no call starts at the last slot (the job's benchmark times eager there).
    cache = Cache(load(exported_with_llm_ops.path, "eager"), slots=16)
    cache.call(torch.zeros(1, 15, dtype=torch.long), 0)
    (logits,) = cache.call(torch.zeros(1, 1, dtype=torch.long), 15)
    assert logits.shape == (1, 1, 512) and bool(torch.isfinite(logits).all())
