"""Artifacts of a causal LM with a static KV cache (model.kv_cache=static): what a .pte carries
for ExecuTorch's LLM runners, and planted cache faults that validation (`artifact=`) fails at
the step where they first show, with the step's first diverging node named where lowering made
the fault."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import ExportedProgram
from transformers.cache_utils import StaticLayer

from exporter import backends, export, models
from exporter.artifact import Artifact
from exporter.localize import Replay, localize
from exporter.models.causal_lm import StaticCacheLM
from exporter.validate import Tolerances, judge, sessions
from runtimes.verdict.sessions import calls_up_to
from tests.conftest import run_command
from tests.test_audit import composed
from tests.test_kv_cache import SMALL
from tests.test_localize import _Module, job_in_process


class OneSlotOff(StaticLayer):
    """A cache layer that writes each position's keys and values one slot further on (the last
    slot's stay in it): position 0's slot is never written."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = key_states.shape[-2]
        slots = torch.arange(count) + self.cumulative_length + 1
        slots = slots.clamp(max=self.max_cache_len - 1)
        self.cumulative_length.add_(count)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values


class Forgetful(StaticCacheLM):
    """A model whose cache is emptied at every call: nothing is kept between calls."""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for name, buffer in self.named_buffers():
            if name.startswith(("key_cache", "value_cache")):
                buffer.zero_()
        return super().forward(input_ids, cache_position)


def one_slot_off(module: StaticCacheLM) -> None:
    for layer in module.static_cache.layers:
        layer.__class__ = OneSlotOff


def forgetful(module: StaticCacheLM) -> None:
    module.__class__ = Forgetful


def lowered(
    out_dir: Path, backend: str, plant: Callable[[StaticCacheLM], None] | None = None
) -> Artifact:
    """The small model's artifact, `plant(module)` changing its cache first."""
    job = composed(f"backend={backend}", *SMALL)
    bundle = models.build(job.model, job.dynamic)
    if plant:
        plant(bundle.module)
    exported = export.run(bundle, job.export, out_dir)
    return backends.configured(job).lower(exported, out_dir)


@pytest.fixture(scope="module")
def one_slot_off_pte(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The .pte of the small model whose cache writes land one slot off."""
    return lowered(tmp_path_factory.mktemp("planted"), "executorch", one_slot_off).path


def test_the_pte_carries_the_metadata_llm_runners_read(one_slot_off_pte: Path) -> None:
    # The metadata comes from the model's config and the lowering, which the planted cache
    # write leaves as they are: the planted .pte serves, and this file lowers the model once.
    program = Runtime.get().load_program(one_slot_off_pte)
    read = {
        name: list(program.load_method(name).execute([]))
        for name in program.method_names
        if name != "forward"
    }
    # The default Llama's config has BOS 1 and EOS 2; 16 slots, seq 1..16, 512 tokens.
    assert read == {
        "get_max_seq_len": [16],
        "get_max_context_len": [16],
        "get_vocab_size": [512],
        "get_n_layers": [1],
        "use_kv_cache": [True],
        "use_sdpa_with_kv_cache": [False],
        "enable_dynamic_shape": [True],
        "get_bos_id": [1],
        "get_eos_ids": [2],
    }


def test_a_cache_write_one_slot_off_fails_at_the_first_prefill(
    one_slot_off_pte: Path, tmp_path: Path
) -> None:
    """Slot 0 is never written: the very first call, a prefill of one token, attends to an
    empty slot."""
    record, report = job_in_process(
        tmp_path,
        "backend=executorch",
        *SMALL,
        f"artifact={one_slot_off_pte}",
        "validate.localize=off",
    )
    assert record.exit_code == 1
    assert report["first_failed_step"] == {"session": 0, "pos": 0, "seq": 1}
    assert "The first step that fails is session 0's prefill at position 0" in str(record.error)
    assert not any(e["passed"] for e in report["executions"])


def test_a_cache_not_kept_between_calls_fails_at_the_first_decode_step(tmp_path: Path) -> None:
    """The prefill reads only what it wrote itself and passes; the first decode step reads the
    prefill's entries, which are gone. The search lowers the right model's program again, which
    passes there: the artifact is not what lowering makes."""
    program = lowered(tmp_path / "planted", "eager", forgetful).path
    record, report = job_in_process(
        tmp_path / "run", "backend=eager", *SMALL, f"artifact={program}"
    )
    assert record.exit_code == 1
    first = {"session": 0, "pos": 1, "seq": 1}
    assert report["first_failed_step"] == first
    assert "session 0's decode step at position 1 (session=0,pos=1,seq=1)" in str(record.error)
    passed = [e["shape"] for e in report["executions"] if e["passed"]]
    # Every prefill passes, and no decode step does.
    assert all(s["pos"] == 0 for s in passed) and len(passed) == 3
    found = report["first_divergence"]
    assert (found["reproduced"], found["shape"]) == (False, first)
    assert "not what lowering makes now" in found["reason"]
    # Its weights are the model's; its cache is state, which the goldens' sessions filled in
    # the model's: the audit skips it rather than calling it a changed weight.
    audit = report["weights_audit"]
    assert audit["passed"] and audit["mismatched"] == []
    assert "key_cache_0" in audit["skipped_state"]


def forget_cache_writes(program: ExportedProgram) -> ExportedProgram:
    """A rewrite a lowering could make: each cache write lands in a fresh zero tensor instead
    of the cache, which then keeps nothing between calls."""
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.index_copy_.default:
            cache = node.args[0]
            with graph.inserting_before(node):
                fresh = graph.call_function(torch.ops.aten.zeros_like.default, (cache,))
            fresh.meta["val"] = cache.meta["val"]
            node.replace_input_with(cache, fresh)
    program.graph_module.recompile()
    return program


def test_a_cache_write_that_forgets_is_named_at_the_step_where_it_shows(tmp_path: Path) -> None:
    """The search replays the session up to the failing step on each lowered part and judges
    each node against eager with the cache as those calls left it: the cache write is named
    (judged from empty buffers, eager's write would agree with the planted one)."""
    job = composed("backend=eager", *SMALL)
    bundle = models.build(job.model, job.dynamic)
    export.run(bundle, job.export, tmp_path)
    (seq,) = bundle.dims
    planned = sessions.plan(bundle.decoder, seq, job.validate.sampled_positions, 0)
    expected = sessions.compute(bundle, planned, 0, "cpu")
    # Read back as the job's stages read it: its cache as export saved it, empty (the module's
    # buffers, which the goldens filled, are not the program's).
    program = export.load(tmp_path, ()).program
    shape = {"session": 1, "pos": 9, "seq": 1}
    rule = Tolerances("reference", 1e-4, 1e-3, factor=5.0, floor=1e-5)

    def lower(part: ExportedProgram, folder: Path) -> Callable[[], _Module]:
        planted = forget_cache_writes(copy.deepcopy(part))
        return lambda: _Module(planted)

    def fails(outputs: tuple[torch.Tensor, ...]) -> bool:
        return not all(s.within for s in judge(("logits",), outputs, shape, expected, rule))

    calls = calls_up_to(planned, shape)
    # Session 0 to its last slot, then session 1's prefill of 9 and its first decode step.
    assert [int(positions[0]) for _, positions in calls][-3:] == [15, 0, 9]
    assert len(calls) == 16 + 2
    replay = Replay(tuple((call, i == 0) for i, call in enumerate(calls)), shape)
    found = localize(program, lower, replay, fails, rule, tmp_path / "search")
    assert found.summary() == "index_copy_ (aten.index_copy_.default)"
    assert found.shape == shape
    assert "cache_utils.py" in found.source and "self.keys.index_copy_(" in found.source
    assert found.module == "model.model.layers.0.self_attn (LlamaAttention)"


@pytest.mark.slow
def test_a_lowering_that_makes_the_cache_forget_is_named_by_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same fault made by the executorch backend's own rewrites: the job fails at the first
    decode step and its search, lowering cut parts with the same rewrites, names the write
    (transformers' ops: backend.llm_ops=plain)."""
    from exporter.backends.common import xnnpack_rewrites

    for_xnnpack = xnnpack_rewrites.for_xnnpack
    monkeypatch.setattr(
        xnnpack_rewrites, "for_xnnpack", lambda p: forget_cache_writes(for_xnnpack(p))
    )
    record, report = job_in_process(tmp_path, "backend=executorch", "backend.llm_ops=plain", *SMALL)
    assert record.exit_code == 1
    first = {"session": 0, "pos": 1, "seq": 1}
    assert report["first_failed_step"] == first
    found = report["first_divergence"]
    assert (found["node"], found["op"], found["shape"]) == (
        "index_copy_",
        "aten.index_copy_.default",
        first,
    )
    assert "self.keys.index_copy_(" in found["source"]
    assert "The first node that diverges is index_copy_" in str(record.error)


def test_a_given_pte_bounded_below_the_plan_is_judged_within_its_bounds(tmp_path: Path) -> None:
    """A program exported for 8 tokens (its input's bound and its cache's 8 slots), judged by a
    job whose bounds go to 16: the live shapes and the model's cache take the artifact's bounds,
    where a longer call would stop its runtime."""
    job = composed("backend=executorch", *SMALL[:-1], "dynamic.seq.max=8")
    bundle = models.build(job.model, job.dynamic, backends.configured(job).llm_ops)
    exported = export.run(bundle, job.export, tmp_path / "short")
    short = backends.configured(job).lower(exported, tmp_path / "short").path
    run_dir = tmp_path / "judged"
    completed = run_command(
        tmp_path,
        f"hydra.run.dir={run_dir}",
        "backend=executorch",
        *SMALL,
        f"artifact={short}",
        "validate.localize=off",
        "benchmark=off",
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "holds seq up to 8 (its inputs' sizes): the live shapes go to 8, not " in output
    report = json.loads((run_dir / "report.json").read_text())
    # Every session fills the artifact's 8 slots: its prefill's, then one per call after it
    # (steps_run counts the prefill's call too).
    assert [s["prefill"] + s["steps_run"] - 1 for s in report["sessions"]] == [8] * 3
    assert max(step["shape"]["seq"] for step in report["executions"]) <= 8
    # Live shapes the artifact cannot hold at all: refused, naming the bound to change.
    refused = run_command(
        tmp_path,
        f"hydra.run.dir={tmp_path / 'refused'}",
        "backend=executorch",
        *SMALL,
        "dynamic.seq.min=9",
        f"artifact={short}",
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"artifact={short}: its inputs hold seq up to 8, below dynamic.seq.min=9" in (
        refused.stdout + refused.stderr
    )
    assert "Traceback" not in refused.stdout + refused.stderr
