"""A causal LM exported with a static KV cache (model.kv_cache=static): validated by sessions of a
prefill and decode steps to the cache's last slot, on one loaded artifact."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from exporter import export, models
from exporter.errors import ConfigError
from runtimes import load
from runtimes.verdict.sessions import Cache, CacheRefused
from tests.conftest import job_in_process
from tests.test_audit import composed

# One layer and 16 cache slots: every step of three sessions runs in a second.
SMALL = ("model.num_hidden_layers=1", "model.kv_cache=static", "dynamic.seq.max=16")


def test_sessions_reach_the_last_slot_and_pass(tmp_path: Path) -> None:
    # eager: the sessions' plan and verdict without a lowering (test_kv_report.py's job runs
    # them on executorch).
    record, report = job_in_process(tmp_path, "backend=eager", *SMALL)
    assert record.error is None
    steps = [e["shape"] for e in report["executions"]]
    # Prefills of seq's min, an odd middle length and its max, each from position 0.
    assert [s["seq"] for s in steps if s["pos"] == 0] == [1, 9, 16]
    sessions = {s["session"] for s in steps}
    assert sessions == {0, 1, 2}
    # The first decode step and the last slot of every session that decodes are judged.
    for session, prefill in ((0, 1), (1, 9)):
        positions = [s["pos"] for s in steps if s["session"] == session]
        assert prefill in positions and 15 in positions
    assert all(e["passed"] for e in report["executions"])
    ratios = [o["ratio"] for e in report["executions"] for o in e["outputs"]]
    assert max(ratios) < 4
    greedy = report["greedy"]
    assert len(greedy["oracle"]) == 8 and greedy["artifact_parts_from_oracle_at"] is None


def test_the_cache_refuses_positions_past_its_end_or_out_of_order(tmp_path: Path) -> None:
    job = composed("backend=eager", *SMALL)
    bundle = models.build(job.model, job.dynamic)
    exported = export.run(bundle, job.export, tmp_path)
    cache = Cache(load(exported.path, "eager"), slots=16)
    (logits,) = cache.call(torch.zeros(1, 15, dtype=torch.long), 0)
    assert logits.shape == (1, 15, 512)
    with pytest.raises(CacheRefused, match=r"positions 16\.\.16 do not follow on"):
        cache.call(torch.zeros(1, 1, dtype=torch.long), 16)
    cache.call(torch.zeros(1, 1, dtype=torch.long), 15)
    with pytest.raises(CacheRefused, match=r"run past the cache's last slot \(15"):
        cache.call(torch.zeros(1, 1, dtype=torch.long), 16)
    # A new session starts at 0.
    assert cache.call(torch.zeros(1, 2, dtype=torch.long), 0)[0].shape == (1, 2, 512)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.max_cache_len=32",), "model.max_cache_len=32 sizes a KV cache"),
        (
            ("model.kv_cache=static", "model.max_cache_len=8"),
            r"dynamic.seq.max is 128, beyond model.max_cache_len \(8\)",
        ),
        (("model.kv_cache=static", "model.max_cache_len=1"), "model.max_cache_len is 1"),
    ],
)
def test_a_cache_that_cannot_hold_the_prefill_is_refused_at_compose(
    overrides: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        composed(*overrides)


def test_the_model_goes_once_its_strict_export_has_gone(tmp_path: Path) -> None:
    # A KV-cache model exports strict (through Dynamo), which in torch 2.14 left the captured
    # graph, and with it every parameter, in a global of Dynamo's: the job's stages after
    # export held the model's weights a second time.
    job = composed("backend=eager", *SMALL)
    bundle = models.build(job.model, job.dynamic)
    assert bundle.export_strict
    weights = [weakref.ref(p) for p in bundle.module.parameters()]
    exported = export.run(bundle, job.export, tmp_path)
    del bundle, exported
    gc.collect()
    assert [w() for w in weights if w() is not None] == []


def test_generation_stops_at_the_configs_eos_and_the_generation_configs_too() -> None:
    """An instruct model's end of turn is in its generation config (Llama 3's 128009), beside
    the config's EOS."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from exporter.models.causal_lm import eos_ids

    config = LlamaConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=64,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[5, 2, 9])
    assert eos_ids(model) == (2, 5, 9)
    model.generation_config = GenerationConfig()
    assert eos_ids(model) == (2,)
