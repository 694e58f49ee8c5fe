"""Where a KV-cache job's sessions show: report.json's sessions, the terminal's table of them and
its closing greedy line, MLflow metrics stepped by position, the plots per position, the weights
audit that skips the cache's buffers, the bundle that `python -m runtimes.check` replays by
session; and its benchmark: prefill at seq's min, middle and max from position 0, a decode step
at the first decode step's fill, half the cache and its last slot, beside eager running the same
cache, in report.json, MLflow's metrics and the summary. One job serves every test."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from exporter.tracking import comparison
from exporter.tracking.comparison import JobSummary
from exporter.tracking.comparison.plots import ERROR_PLOT
from tests.conftest import CliResult, run_exporter
from tests.drawn_plots import Panel, job_colours, panels, saved_figures
from tests.test_bundle import check
from tests.test_kv_cache import SMALL

# Prefills of seq's min, an odd middle and its max, each decoding to the cache's last slot (15).
PREFILLS = [1, 9, 16]
STEPS_RUN = [16, 8, 1]


@pytest.fixture(scope="module")
def kv_job(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    result = run_exporter(tmp_path_factory.mktemp("kv"), "backend=executorch", *SMALL)
    assert result.exit_code == 0, result.output
    return result


def judged_steps(report: dict) -> list[tuple[int, int]]:
    """(session, position) of every judged step, as the executions ran them."""
    return [(e["shape"]["session"], e["shape"]["pos"]) for e in report["executions"]]


def test_report_json_has_a_section_per_session_and_step(kv_job: CliResult) -> None:
    report = kv_job.report()
    sessions = report["sessions"]
    assert [s["prefill"] for s in sessions] == PREFILLS
    assert [s["steps_run"] for s in sessions] == STEPS_RUN
    assert [(s["session"], step["position"]) for s in sessions for step in s["steps"]] == (
        judged_steps(report)
    )
    assert sum(s["steps_judged"] for s in sessions) == len(report["executions"])
    for session in sessions:
        steps = session["steps"]
        # The prefill takes its tokens at position 0; each decode step one token.
        assert (steps[0]["position"], steps[0]["tokens"]) == (0, session["prefill"])
        assert all(step["tokens"] == 1 for step in steps[1:])
        assert session["worst_ratio"] == max(step["ratio"] for step in steps)
        worst = max(steps, key=lambda step: step["ratio"])
        assert session["worst_ratio_at"] == worst["position"]
        assert session["worst_max_abs"] == max(step["max_abs"] for step in steps)
        assert all(0 < step["max_abs"] < 1e-5 and step["ref_max_abs"] > 0 for step in steps)
        assert session["passed"] and all(step["passed"] for step in steps)
    # Beside what other code reads, unchanged: a shape per judged step, and its execution.
    assert len(report["shapes"]) == len(report["executions"]) == 18


def test_one_token_steps_are_judged_against_at_least_eagers_median_error(
    kv_job: CliResult,
) -> None:
    # Eager's error at a step where it rounded better than usual is raised to its median over
    # the one-token steps, so no step's reference lies below the median of them all.
    report = kv_job.report()
    steps = [step for s in report["sessions"] for step in s["steps"] if step["tokens"] == 1]
    assert len(steps) >= 5
    for measure in ("ref_nrmse", "ref_max_abs"):
        references = [step[measure] for step in steps]
        assert min(references) == statistics.median_high(references) > 0


def test_the_terminal_shows_a_row_per_session_and_the_greedy_line(kv_job: CliResult) -> None:
    table = kv_job.output.split("[validate] report (")[1]
    header, _, *rows = table.splitlines()[1:6]
    assert header.split()[:4] == ["session", "prefill", "steps", "judged"]
    assert [row.split()[:4] for row in rows[:3]] == [
        [str(n), str(prefill), str(steps), str(s["steps_judged"])]
        for n, (prefill, steps, s) in enumerate(
            zip(PREFILLS, STEPS_RUN, kv_job.report()["sessions"], strict=True)
        )
    ]
    assert "session=0,pos=0,seq=1   1" not in table.split("[validate] weights audit")[0]
    closing = kv_job.output.split("[job] PASSED")[1]
    assert closing.startswith(" (exit 0) at all 18 judged steps of 3 sessions")
    assert "[job] greedy 8 tokens: the artifact's agree with the oracle's on all 8" in closing


def test_mlflow_steps_each_session_by_position(kv_job: CliResult) -> None:
    (run,) = kv_job.mlflow_runs()
    client = MlflowClient(kv_job.tracking_uri)
    report = kv_job.report()
    for session in report["sessions"]:
        history = client.get_metric_history(
            run.info.run_id, f"session{session['session']}.max_abs_err"
        )
        assert {m.step: m.value for m in history} == {
            step["position"]: pytest.approx(step["max_abs"]) for step in session["steps"]
        }
    metrics = run.data.metrics
    assert metrics["greedy_tokens"] == 8
    assert metrics["greedy_agreed_artifact_vs_oracle"] == 8
    assert metrics["greedy_agreed_eager_vs_oracle"] == 8
    # The step is the position: no tags map steps to shapes, no metric per shape's index.
    assert not [tag for tag in run.data.tags if tag.startswith("step.")]
    assert "max_abs_err" not in metrics


def test_the_weights_audit_skips_the_cache_buffers(kv_job: CliResult) -> None:
    audit = kv_job.report()["weights_audit"]
    assert sorted(audit["skipped_state"]) == ["cumulative_length_0", "key_cache_0", "value_cache_0"]
    assert audit["unseen"] == []
    assert not set(audit["skipped_state"]) & set(audit["checked_at"])
    assert "0 unseen, 3 state buffers skipped" in kv_job.output


def test_the_error_plot_is_per_position(
    kv_job: CliResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = json.loads((kv_job.run_dir / "summary.json").read_text())
    assert summary["greedy"].startswith("greedy 8 tokens")
    plot = kv_job.run_dir / ERROR_PLOT
    # One panel, 7 inches at 110 dpi: error against position, not a panel per name of the
    # step's shape (session, pos, seq); the job's line drawn in its colour.
    assert Image.open(plot).size == (770, 495)
    assert job_colours(plot) == [0]
    # What the plot draws, from the summary the job drew it from: a line per session, each
    # judged step's error at its position, as report.json has them.
    figures = saved_figures(monkeypatch)
    comparison.write_plots([JobSummary.read(kv_job.run_dir)], ["job"], tmp_path)
    sessions = kv_job.report()["sessions"]
    assert panels(figures[0]) == [
        Panel(
            "position of the step in the KV cache",
            {
                f"job session {session['session']}": [
                    (step["position"], step["max_abs"]) for step in session["steps"]
                ]
                for session in sessions
            },
        )
    ]


def test_the_bundle_replays_the_sessions_and_passes(kv_job: CliResult, tmp_path: Path) -> None:
    bundle = kv_job.run_dir / "bundle"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["format"] == 3
    assert [s["prefill"] for s in manifest["sessions"]] == PREFILLS
    assert [s["steps"] for s in manifest["sessions"]] == STEPS_RUN

    completed = check(bundle, tmp_path / "report.json")

    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "3 sessions (prefills 1, 9, 16; 25 steps), 18 judged" in completed.stdout
    assert "passed at all 18 judged steps" in completed.stdout
    checked, job = json.loads((tmp_path / "report.json").read_text()), kv_job.report()
    assert judged_steps(checked) == judged_steps(job)
    # The same artifact on the same CPU, judged by the same code against the same goldens.
    assert [e["outputs"][0]["max_abs"] for e in checked["executions"]] == pytest.approx(
        [e["outputs"][0]["max_abs"] for e in job["executions"]], rel=1e-3
    )
    assert checked["greedy"]["artifact"] == job["greedy"]["artifact"]


def test_the_bundle_check_fails_where_a_step_fails(kv_job: CliResult, tmp_path: Path) -> None:
    bundle = Path(shutil.copytree(kv_job.run_dir / "bundle", tmp_path / "bundle"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    steps = [
        (s["session"], step["position"], step["ratio"])
        for s in kv_job.report()["sessions"]
        for step in s["steps"]
    ]
    *_, second, worst = sorted(steps, key=lambda step: step[2])
    # Without the floor, a step passes where its ratio to eager's error is within the factor:
    # a factor between the two largest ratios fails the worst step alone.
    manifest["tolerances"]["floor"] = 0.0
    manifest["tolerances"]["factor"] = (second[2] + worst[2]) / 2
    (bundle / "manifest.json").write_text(json.dumps(manifest))

    completed = check(bundle, tmp_path / "report.json")

    assert completed.returncode == 1, completed.stdout + completed.stderr
    checked = json.loads((tmp_path / "report.json").read_text())
    failed = [
        (s["session"], step["position"])
        for s in checked["sessions"]
        for step in s["steps"]
        if not step["passed"]
    ]
    assert failed == [worst[:2]]
    assert [s["passed"] for s in checked["sessions"]] == [n != worst[0] for n in range(3)]


def test_prefill_and_decode_are_timed_beside_eager(kv_job: CliResult) -> None:
    timed = kv_job.report()["benchmark"]
    # Prefills of the sessions' lengths, each from position 0.
    assert [(c["position"], c["tokens"]) for c in timed["prefill"]] == [(0, 1), (0, 9), (0, 16)]
    # A decode step after the shortest prefill, at half the 16 slots and at the last slot.
    assert [(c["position"], c["tokens"]) for c in timed["decode"]] == [(1, 1), (8, 1), (15, 1)]
    assert timed["shapes"] == []
    # A tiny model's artifact and program: loaded at once, taking turns.
    assert timed["together"] is True
    speedups = []
    for call in timed["prefill"] + timed["decode"]:
        assert 0 < call["min_ms"] <= call["median_ms"] <= call["p90_ms"]
        assert call["runs"] >= 1
        assert call["tokens_per_s"] == pytest.approx(call["tokens"] * 1e3 / call["median_ms"])
        eager = call["eager"]
        assert eager["median_ms"] > 0
        assert call["eager_tokens_per_s"] == pytest.approx(
            call["tokens"] * 1e3 / eager["median_ms"]
        )
        assert call["speedup_vs_eager"] == pytest.approx(eager["median_ms"] / call["median_ms"])
        speedups.append(call["speedup_vs_eager"])
    assert timed["worst_speedup_vs_eager"] == pytest.approx(min(speedups))


def test_mlflow_gets_tokens_per_second_stepped_by_length_and_fill(kv_job: CliResult) -> None:
    (run,) = kv_job.mlflow_runs()
    client = MlflowClient(kv_job.tracking_uri)

    def steps(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    timed = kv_job.report()["benchmark"]
    decode = {c["position"]: c for c in timed["decode"]}
    prefill = {c["tokens"]: c for c in timed["prefill"]}
    assert steps("decode_ms") == {p: pytest.approx(c["median_ms"]) for p, c in decode.items()}
    assert steps("decode_tokens_per_s") == {
        p: pytest.approx(c["tokens_per_s"]) for p, c in decode.items()
    }
    assert steps("eager_decode_ms").keys() == {1, 8, 15}
    assert steps("decode_speedup_vs_eager").keys() == {1, 8, 15}
    assert steps("prefill_tokens_per_s") == {
        n: pytest.approx(c["tokens_per_s"]) for n, c in prefill.items()
    }
    assert steps("prefill_speedup_vs_eager").keys() == {1, 9, 16}
    # The live shapes' latency is for models without a cache.
    assert "latency_ms" not in run.data.metrics


def test_the_summary_gets_decode_and_prefill_tokens_per_second(kv_job: CliResult) -> None:
    timed = kv_job.report()["benchmark"]
    summary = json.loads((kv_job.run_dir / "summary.json").read_text())
    assert summary["decode_tokens_per_s"] == pytest.approx(timed["decode"][-1]["tokens_per_s"])
    assert summary["prefill_tokens_per_s"] == pytest.approx(timed["prefill"][-1]["tokens_per_s"])
    assert summary["worst_speedup_vs_eager"] == pytest.approx(timed["worst_speedup_vs_eager"])
    assert summary["speedup_vs_eager"] == []
    decode = f"[job] decode {summary['decode_tokens_per_s']:.0f} tokens/s at the last slot"
    assert decode in kv_job.output
