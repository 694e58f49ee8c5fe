"""model.kv_cache=static beyond eager and executorch: an AOTInductor package on the CPU and a
WebGPU program on lavapipe, each keeping its cache between the calls of one loaded instance and
passing every session's judged steps; each new AOTInductor load starts from an empty cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtimes import load
from runtimes.verdict.sessions import Cache, CacheRefused
from tests.test_kv_cache import SMALL
from tests.test_localize import job_in_process


# The AOTInductor job took 87 s and, as a test, 337 s on a busy 2-core machine, most of it the
# compile: it runs with -m slow, as the other Llama packages do (tests/test_aoti.py).
@pytest.fixture(scope="module")
def aoti_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One AOTInductor KV-cache job (its compile is the slow part): its run dir and report."""
    run_dir = tmp_path_factory.mktemp("aoti-kv")
    record, report = job_in_process(run_dir, "backend=aoti", *SMALL)
    assert record.error is None
    return run_dir, report


def assert_sessions_passed(report: dict) -> None:
    steps = [e["shape"] for e in report["executions"]]
    assert {s["session"] for s in steps} == {0, 1, 2}
    # Every session that decodes is judged at the cache's last slot.
    assert {s["session"] for s in steps if s["pos"] == 15 and s["seq"] == 1} == {0, 1}
    assert all(e["passed"] for e in report["executions"])
    assert max(o["ratio"] for e in report["executions"] for o in e["outputs"]) < 4
    greedy = report["greedy"]
    assert greedy["artifact"] == greedy["eager"] == greedy["oracle"]
    assert len(greedy["artifact"]) == 8


@pytest.mark.slow
def test_an_aoti_package_keeps_its_cache_between_calls_and_passes(
    aoti_job: tuple[Path, dict],
) -> None:
    assert_sessions_passed(aoti_job[1])


@pytest.mark.slow
def test_each_load_of_an_aoti_package_starts_from_an_empty_cache(
    aoti_job: tuple[Path, dict],
) -> None:
    package = aoti_job[0] / "model.pt2"
    tokens = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    first = load(package, "aoti")
    first.run((tokens[:, :8], torch.arange(8)))
    # A second load decodes position 8 over its own, empty cache: had it shared the first
    # load's buffers, it would read the prefill there and give the first load's logits.
    (fresh,) = load(package, "aoti").run((tokens[:, 8:], torch.tensor([8])))
    (continued,) = first.run((tokens[:, 8:], torch.tensor([8])))
    (whole,) = load(package, "aoti").run((tokens, torch.arange(9)))
    torch.testing.assert_close(continued[0, -1], whole[0, -1], atol=1e-5, rtol=0)
    assert (fresh - continued).abs().max() > 1e-2


@pytest.mark.slow
def test_the_cache_driver_refuses_what_an_aoti_package_would_run_past_its_end(
    aoti_job: tuple[Path, dict],
) -> None:
    cache = Cache(load(aoti_job[0] / "model.pt2", "aoti"), slots=16)
    cache.call(torch.zeros(1, 16, dtype=torch.long), 0)
    with pytest.raises(CacheRefused, match=r"run past the cache's last slot \(15"):
        cache.call(torch.zeros(1, 1, dtype=torch.long), 16)
    # A prefill as long as the cache, after it is full, starts a new session.
    (logits,) = cache.call(torch.zeros(1, 16, dtype=torch.long), 0)
    assert logits.shape == (1, 16, 512)


def test_a_webgpu_program_keeps_its_cache_between_calls_and_passes_on_lavapipe(
    tmp_path: Path,
) -> None:
    record, report = job_in_process(tmp_path, "backend=webgpu", "backend.device=cpu", *SMALL)
    assert record.error is None
    assert_sessions_passed(report)
    assert "llvmpipe" in report["target"]["adapter"]
    # The cache's readers stay in the program, off the delegates, which would hold the buffers
    # they read as constants.
    nodes = json.loads((tmp_path / "partition.json").read_text())["nodes"]
    readers = {n["node"]: n["detail"] for n in nodes if "mutable buffer" in n["detail"]}
    assert readers == {
        "aten_copy_default": ANY_READER.format("cumulative_length_0"),
        "aten_index_put_default": ANY_READER.format("key_cache_0"),
        "aten_index_put_default_1": ANY_READER.format("value_cache_0"),
    }


ANY_READER = (
    "it reads the mutable buffer {}, which a VulkanBackend payload would hold as a constant: "
    "mutable buffers and their readers stay in the program"
)
