"""The validation report: every execution's statistics, the worst per live shape, and a table;
for a model with a KV cache, the same per session and step (the step's shape names its session,
position and tokens: `session=0,pos=7,seq=1`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from runtimes.verdict.shapes import LiveShape, label
from runtimes.verdict.stats import OutputStats, Tolerances

# The statistics that are worse when larger, in report order: the artifact's errors against
# the float64 oracle, eager's at the model's dtype (ref_*), their ratio, and what would pass.
STATS = (
    "max_abs",
    "mean_abs",
    "max_rel",
    "p99_abs",
    "nrmse",
    "ref_max_abs",
    "ref_nrmse",
    "ratio",
    "needed_factor",
    "needed_atol",
    "kl_mean",
    "ref_kl_mean",
    "kl_max",
    "ref_kl_max",
)
# What next-token logits predict that is worse when smaller: top-1 agreement with the oracle.
AGREEMENT_STATS = ("top1", "ref_top1")
# The terminal's table: the errors the rules read.
TABLE_STATS = ("max_abs", "ref_max_abs", "nrmse", "ref_nrmse", "ratio", "needed_atol")
# Beside them, for a model whose outputs include next-token logits: what it predicts.
PREDICTION_STATS = ("top1", "ref_top1", "kl_mean", "ref_kl_mean")


@dataclass(frozen=True)
class Execution:
    shape: LiveShape
    # "same instance": the one loaded instance that runs every shape; "new instance": a newly
    # loaded one.
    instance: str
    # The execution's wall time, copies included: what it took, not a benchmark (one run, maybe
    # the first at its shape); the benchmark stage measures latency.
    wall_ms: float
    outputs: tuple[OutputStats, ...]

    @property
    def passed(self) -> bool:
        return all(output.passed for output in self.outputs)


@dataclass(frozen=True)
class ShapeResult:
    """One live shape: the worst of each statistic over its executions and outputs (NaN where
    none measured it). `by_distribution`: it passed by the half rule's predictions."""

    shape: LiveShape
    runs: int
    stats: dict[str, float]
    passed: bool
    by_distribution: bool = False


@dataclass(frozen=True)
class Generation:
    """Greedy tokens generated from one prompt by the artifact, eager at the model's dtype with
    the same cache, and the float64 oracle recomputing the whole prefix; where each parts from
    the oracle's (None: nowhere). `text`: the prompt and each generation decoded, where the
    prompt was text (validate.prompt)."""

    prompt: list[int]
    artifact: list[int]
    eager: list[int]
    oracle: list[int]
    text: dict[str, str] | None = None

    @property
    def artifact_parts_at(self) -> int | None:
        return _parts_at(self.artifact, self.oracle)

    @property
    def eager_parts_at(self) -> int | None:
        return _parts_at(self.eager, self.oracle)

    @property
    def artifact_parts_from_eager_at(self) -> int | None:
        return _parts_at(self.artifact, self.eager)

    def line(self) -> str:
        def said(at: int | None) -> str:
            return "all agree" if at is None else f"first differs at token {at}"

        return (
            f"greedy {len(self.oracle)} tokens from a {len(self.prompt)}-token prompt: artifact "
            f"vs oracle {said(self.artifact_parts_at)}; eager vs oracle "
            f"{said(self.eager_parts_at)}; artifact vs eager "
            f"{said(self.artifact_parts_from_eager_at)}"
        )

    def agreement(self) -> dict[str, int]:
        """How many greedy tokens two generations share before they part (all of them where they
        never do): the artifact's with the oracle's, eager's with the oracle's, the artifact's
        with eager's."""
        return {
            "artifact_vs_oracle": _agreed(self.artifact_parts_at, self.oracle),
            "eager_vs_oracle": _agreed(self.eager_parts_at, self.oracle),
            "artifact_vs_eager": _agreed(self.artifact_parts_from_eager_at, self.eager),
        }

    def summary(self) -> str:
        """The generation in a line short enough to close a job with: `greedy 16 tokens: the
        artifact's agree with the oracle's on all 16, eager's on the first 9`."""
        count = len(self.oracle)

        def on(agreed: int) -> str:
            return f"all {count}" if agreed == count else f"the first {agreed}"

        agreed = self.agreement()
        return (
            f"greedy {count} tokens: the artifact's agree with the oracle's on "
            f"{on(agreed['artifact_vs_oracle'])}, eager's on {on(agreed['eager_vs_oracle'])}"
        )

    def to_json(self) -> dict:
        return {
            "prompt": self.prompt,
            "artifact": self.artifact,
            "eager": self.eager,
            "oracle": self.oracle,
            "artifact_parts_from_oracle_at": self.artifact_parts_at,
            "eager_parts_from_oracle_at": self.eager_parts_at,
            "artifact_parts_from_eager_at": self.artifact_parts_from_eager_at,
            **({"text": self.text} if self.text is not None else {}),
        }

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Generation:
        return cls(
            payload["prompt"],
            payload["artifact"],
            payload["eager"],
            payload["oracle"],
            payload.get("text"),
        )


def _agreed(parts_at: int | None, reference: Sequence[int]) -> int:
    return len(reference) if parts_at is None else parts_at


def _parts_at(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    for index, (token, expected) in enumerate(zip(tokens, reference, strict=False)):
        if token != expected:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


@dataclass(frozen=True)
class Session:
    """A session of a model with a KV cache as it ran: its prefill's length and its calls, the
    prefill then one decode step per slot left (only some of them judged)."""

    prefill: int
    steps: int


@dataclass(frozen=True)
class SessionResult:
    """A session's verdict: its judged steps' results, position order."""

    number: int
    session: Session
    judged: tuple[ShapeResult, ...]

    @property
    def passed(self) -> bool:
        return all(result.passed for result in self.judged)

    def worst_ratio_at(self) -> tuple[float, int] | None:
        """The largest error ratio over the judged steps, and its step's position; None where no
        step measured one."""
        measured = [r for r in self.judged if not math.isnan(r.stats["ratio"])]
        if not measured:
            return None
        worst = max(measured, key=lambda result: result.stats["ratio"])
        return worst.stats["ratio"], worst.shape["pos"]

    def worst(self, stat: str) -> float:
        return _worst(result.stats[stat] for result in self.judged)


@dataclass(frozen=True)
class Report:
    tolerances: Tolerances
    output_names: tuple[str, ...]
    shapes: tuple[LiveShape, ...]
    executions: tuple[Execution, ...]
    # What the loaded artifact ran on, as its runtime names it (a wgpu adapter's name).
    target: Mapping[str, str] = field(default_factory=dict)
    # A model with a KV cache: its greedy generation beside eager's and the oracle's, and its
    # sessions in the order they ran (their judged steps are `shapes`).
    generation: Generation | None = None
    sessions: tuple[Session, ...] = ()

    @property
    def passed(self) -> bool:
        return all(execution.passed for execution in self.executions)

    def by_shape(self) -> list[ShapeResult]:
        results = []
        for shape in self.shapes:
            runs = [e for e in self.executions if e.shape == shape]
            outputs = [output for run in runs for output in run.outputs]
            results.append(
                ShapeResult(
                    shape=shape,
                    runs=len(runs),
                    stats={stat: _worst(getattr(o, stat) for o in outputs) for stat in STATS}
                    | {stat: _least(getattr(o, stat) for o in outputs) for stat in AGREEMENT_STATS},
                    passed=all(run.passed for run in runs),
                    by_distribution=any(o.by_distribution for o in outputs),
                )
            )
        return results

    def by_session(self) -> list[SessionResult]:
        """Each session's judged steps' results (none for a model without a KV cache)."""
        results = self.by_shape()
        return [
            SessionResult(
                number,
                session,
                tuple(r for r in results if r.shape.get("session") == number),
            )
            for number, session in enumerate(self.sessions)
        ]

    def worst(self, stat: str) -> float:
        pick = _least if stat in AGREEMENT_STATS else _worst
        return pick(result.stats[stat] for result in self.by_shape())

    def worst_ratio_at(self) -> tuple[float, str] | None:
        """The largest error ratio over the shapes that measured one, and that shape's label
        (`seq=1`); None where none did."""
        measured = [r for r in self.by_shape() if not math.isnan(r.stats["ratio"])]
        if not measured:
            return None
        worst = max(measured, key=lambda result: result.stats["ratio"])
        return worst.stats["ratio"], label(worst.shape)

    @property
    def sums_float16_natively(self) -> bool:
        """Whether the runtime was measured summing float16 products in float16 on its CPU
        (runtimes/cpu_arithmetic.py)."""
        return str(self.target.get("float16_sums", "")).startswith("float16")

    def ran_on(self) -> str | None:
        """The CPU the artifact ran on and how it computes half precision, in a line; None
        where the runtime did not say (a GPU says its name in `target`)."""
        if "cpu" not in self.target:
            return None
        line = f"{self.target['cpu']}, half-precision features: {self.target['cpu_features']}"
        if "float16_sums" in self.target:
            line += f"; float16 products summed in {self.target['float16_sums']}"
        return line

    def failed_labels(self) -> list[str]:
        """The live shapes that failed, by label."""
        return [label(result.shape) for result in self.failures()]

    @property
    def predicts(self) -> bool:
        """Whether an output holds next-token logits, whose predictions were measured."""
        return not math.isnan(self.worst("top1"))

    def failures(self) -> list[ShapeResult]:
        return [result for result in self.by_shape() if not result.passed]

    def first_failed_step(self) -> LiveShape | None:
        """A model with a KV cache: the first step, in the order the sessions ran, that
        failed (a wrong cache shows first there; every step after it reads what it wrote);
        None where none did, or the report is of live shapes."""
        failed = (e.shape for e in self.executions if "session" in e.shape and not e.passed)
        return next(failed, None)

    def failure_message(self) -> str:
        """Why validation failed: each output whose dtype is not eager's (no tolerance can pass
        it), then the live shapes whose values differ beyond the rule, with the factor or atol
        that would pass them; a wrong dtype alone names neither, which would be no fix."""
        outputs = [output for execution in self.executions for output in execution.outputs]
        sentences = list(
            dict.fromkeys(
                f"output {o.name} is {o.dtype} where eager gives {o.expected_dtype}."
                for o in outputs
                if o.dtype != o.expected_dtype
            )
        )
        first_step = self.first_failed_step()
        if first_step:
            call = "prefill" if first_step["pos"] == 0 else "decode step"
            sentences.insert(
                0,
                f"The first step that fails is session {first_step['session']}'s {call} at "
                f"position {first_step['pos']} ({label(first_step)}).",
            )
        differ = [e.shape for e in self.executions if any(o.values_differ for o in e.outputs)]
        differing = [result for result in self.by_shape() if result.shape in differ]
        if differing and self.tolerances.scaled:
            failed = ", ".join(
                f"{label(r.shape)} (nrmse {r.stats['nrmse']:.3g}, eager "
                f"{r.stats['ref_nrmse']:.3g}; max_abs {r.stats['max_abs']:.3g}, eager "
                f"{r.stats['ref_max_abs']:.3g})"
                for r in differing
            )
            sentences.append(
                f"{len(differing)} of {len(self.shapes)} live shapes are less accurate than "
                f"eager at the model's dtype beyond {self.tolerances.describe()}: {failed}. "
                f"The smallest validate.factor that would pass them all is "
                f"{self.worst('needed_factor'):.3g}."
            )
            if self.predicts:
                sentences.append(_predictions(differing))
            if self.sums_float16_natively:
                sentences.append(
                    f"This CPU ({self.ran_on()}) sums float16 products in float16 in the "
                    f"runtime's kernels, where eager PyTorch on a CPU sums them in float32: a "
                    f"correct artifact is less accurate here than eager, and the verdict holds "
                    f"for this arithmetic. On a CPU without float16 arithmetic it sums as eager "
                    f"does; to accept this one's, raise validate.factor and validate.kl_factor "
                    f"to what the figures above need."
                )
        elif differing:
            failed = ", ".join(
                f"{label(r.shape)} (max_abs {r.stats['max_abs']:.3g})" for r in differing
            )
            sentences.append(
                f"{len(differing)} of {len(self.shapes)} live shapes differ from eager beyond "
                f"{self.tolerances.describe()}: {failed}. The smallest atol that would "
                f"pass them all is {self.worst('needed_atol'):.3g}."
            )
        return " ".join(sentences)

    def table(self) -> str:
        """The statistics per live shape; for next-token logits, what they predict too, and a
        line under the table for the shapes that passed by their predictions alone. A model
        with a KV cache: a row per session instead (report.json has every judged step)."""
        if self.sessions:
            return self._sessions_table()
        stats = TABLE_STATS + (PREDICTION_STATS if self.predicts else ())
        results = self.by_shape()
        rows = [
            [
                label(result.shape),
                result.runs,
                *(f"{result.stats[stat]:.3g}" for stat in stats),
                _verdict(result),
            ]
            for result in results
        ]
        table = _table(["shape", "runs", *stats, "verdict"], rows)
        by_distribution = [result for result in results if result.by_distribution]
        if by_distribution:
            table += (
                f"\nok*: {len(by_distribution)} of {len(results)} live shapes are less accurate "
                "than eager beyond the factor, and predict the next token as eager does "
                "(validate.half=distribution; validate.half=strict fails them)"
            )
        return table

    def _sessions_table(self) -> str:
        """A row per session: its prefill, its steps run and judged, its worst error ratio and
        at which position, its worst max_abs beside eager's, and its verdict."""
        rows = []
        for result in self.by_session():
            worst = result.worst_ratio_at()
            rows.append(
                [
                    result.number,
                    result.session.prefill,
                    result.session.steps,
                    len(result.judged),
                    "nan" if worst is None else f"{worst[0]:.3g}",
                    "-" if worst is None else worst[1],
                    f"{result.worst('max_abs'):.3g}",
                    f"{result.worst('ref_max_abs'):.3g}",
                    "ok" if result.passed else "FAIL",
                ]
            )
        headers = ["session", "prefill", "steps", "judged", "worst ratio", "at pos", "max_abs"]
        table = _table([*headers, "eager max_abs", "verdict"], rows)
        return table + "\n(every judged step: report.json's sessions)"

    def _sessions_json(self) -> list[dict]:
        """report.json's sessions: each with its judged steps' figures, position order."""
        sessions = []
        for result in self.by_session():
            worst = result.worst_ratio_at()
            sessions.append(
                {
                    "session": result.number,
                    "prefill": result.session.prefill,
                    "steps_run": result.session.steps,
                    "steps_judged": len(result.judged),
                    "passed": result.passed,
                    "worst_ratio": None if worst is None else worst[0],
                    "worst_ratio_at": None if worst is None else worst[1],
                    "worst_max_abs": result.worst("max_abs"),
                    "worst_ref_max_abs": result.worst("ref_max_abs"),
                    "steps": [
                        {
                            "position": step.shape["pos"],
                            "tokens": step.shape["seq"],
                            **step.stats,
                            "passed": step.passed,
                            "by_distribution": step.by_distribution,
                        }
                        for step in result.judged
                    ],
                }
            )
        return sessions

    def to_json(self) -> dict:
        return json_safe(
            {
                "passed": self.passed,
                **asdict(self.tolerances),
                "outputs": list(self.output_names),
                "target": dict(self.target),
                **({"greedy": self.generation.to_json()} if self.generation else {}),
                **({"sessions": self._sessions_json()} if self.sessions else {}),
                **({"first_failed_step": step} if (step := self.first_failed_step()) else {}),
                "shapes": [
                    {
                        "shape": result.shape,
                        "runs": result.runs,
                        **result.stats,
                        "passed": result.passed,
                        "by_distribution": result.by_distribution,
                    }
                    for result in self.by_shape()
                ],
                "executions": [
                    {
                        "shape": execution.shape,
                        "instance": execution.instance,
                        "wall_ms": execution.wall_ms,
                        "passed": execution.passed,
                        "outputs": [asdict(output) for output in execution.outputs],
                    }
                    for execution in self.executions
                ],
            }
        )

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Report:
        """The report `to_json` wrote (report.json), read back."""
        # A report written before a field existed takes its default.
        tolerances = Tolerances(
            **{f.name: payload[f.name] for f in fields(Tolerances) if f.name in payload}
        )
        executions = tuple(
            Execution(
                execution["shape"],
                execution["instance"],
                float(execution["wall_ms"]),
                tuple(_output_stats(output) for output in execution["outputs"]),
            )
            for execution in payload["executions"]
        )
        return cls(
            tolerances,
            tuple(payload["outputs"]),
            tuple(result["shape"] for result in payload["shapes"]),
            executions,
            dict(payload["target"]),
            Generation.from_json(payload["greedy"]) if "greedy" in payload else None,
            tuple(
                Session(int(s["prefill"]), int(s["steps_run"])) for s in payload.get("sessions", ())
            ),
        )


def execution_line(number: int, total: int, execution: Execution) -> str:
    """One execution as it ends, for a log: its shape, instance, worst errors and verdict."""
    return (
        f"{number:2d}/{total} {label(execution.shape):<12} {execution.instance:<13} "
        f"max_abs {max(s.max_abs for s in execution.outputs):.3g} "
        f"(eager {max(s.ref_max_abs for s in execution.outputs):.3g})  "
        f"{execution.wall_ms:.3f} ms  {'ok' if execution.passed else 'FAIL'}"
    )


def _output_stats(payload: Mapping[str, Any]) -> OutputStats:
    # float() reads back the "inf" and "nan" that json_safe wrote as strings; a field that a
    # report written before it existed lacks takes its default.
    values = {
        f.name: float(payload[f.name]) if f.type == "float" else payload[f.name]
        for f in fields(OutputStats)
        if f.name in payload
    }
    values["shape"], values["golden_shape"] = tuple(values["shape"]), tuple(values["golden_shape"])
    return OutputStats(**values)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table, left-aligned columns two spaces apart under a rule of dashes."""
    cells = [[str(cell) for cell in row] for row in [headers, *rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(line.rstrip() for line in lines)


def _worst(values: Iterable[float]) -> float:
    """The largest, NaN (not measured) only where every value is."""
    measured = [value for value in values if not math.isnan(value)]
    return max(measured) if measured else math.nan


def _least(values: Iterable[float]) -> float:
    """The smallest, NaN (not measured) only where every value is."""
    measured = [value for value in values if not math.isnan(value)]
    return min(measured) if measured else math.nan


def _verdict(result: ShapeResult) -> str:
    if not result.passed:
        return "FAIL"
    return "ok*" if result.by_distribution else "ok"


def _predictions(results: Sequence[ShapeResult]) -> str:
    """What the failing shapes' next-token logits predict, beside eager's at the model's dtype."""
    shapes = ", ".join(
        f"{label(r.shape)} (top-1 {r.stats['top1']:.4g}, eager {r.stats['ref_top1']:.4g}; "
        f"mean KL {r.stats['kl_mean']:.3g}, eager {r.stats['ref_kl_mean']:.3g})"
        for r in results
    )
    return (
        "Next-token predictions against the float64 oracle (top-1 agreement, KL divergence in "
        f"nats): {shapes}."
    )


def json_safe(value: object) -> object:
    """Strict JSON has no inf or NaN; they are written as the strings "inf" and "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value
