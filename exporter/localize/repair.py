"""A failed artifact whose first diverging node is an op that lowering computed otherwise than
eager: the node diverges while the nodes feeding it agree, and its op ran in a delegate. Keeping
that op out of the delegate (`fallback.ops`) is the override to try; `validate.repair=auto`
lowers again with it and validates that artifact, and the job records both artifacts' verdicts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from exporter.artifact.partition import DELEGATED, PartitionSummary
from exporter.config import FallbackConfig, FallbackPolicy
from exporter.errors import ConfigError
from exporter.localize import FirstDivergence, Localization


@dataclass(frozen=True)
class KeepOut:
    """The op to keep out of the delegate, the node of the exported program that showed it,
    and the fallback settings that keep it out."""

    op: str
    node: str
    fallback: FallbackConfig
    # fallback=strict forbids fallback.ops: the override leaves it for auto.
    from_strict: bool = False

    @property
    def override(self) -> str:
        """The command-line override, as a user would type it."""
        ops = f"fallback.ops=[{','.join(self.fallback.ops)}]"
        return f"fallback=auto {ops}" if self.from_strict else ops

    def advice(self) -> str:
        return (
            f"Its inputs agree with eager, so the backend computes {self.op} otherwise than "
            f"PyTorch: `{self.override}` keeps it out of the delegate (validate.repair=auto "
            "lowers again so and validates that artifact)."
        )


def keep_out(
    localization: Localization | None,
    partition: PartitionSummary | None,
    fallback: FallbackConfig,
) -> KeepOut | None:
    """The op to keep out where the first divergence is one op's own (its inputs within the
    rule) and keeping it out can change something: the backend delegates (a partition report),
    the op ran in a delegate, and fallback.ops does not already name it. None otherwise."""
    if not isinstance(localization, FirstDivergence) or localization.error.within:
        return None
    if not all(error.within for error in localization.inputs):
        return None
    op = localization.op
    if partition is None or op in fallback.ops:
        return None
    placed = [node for node in partition.nodes if node.op == op]
    # Where no node has the op's name it was decomposed or rewritten: it may have been delegated.
    if placed and not any(node.reason == DELEGATED for node in placed):
        return None
    strict = fallback.policy is FallbackPolicy.strict
    try:
        kept_out = dataclasses.replace(
            fallback,
            policy=FallbackPolicy.auto if strict else fallback.policy,
            ops=[*fallback.ops, op],
        )
    except ConfigError:
        # An op fallback.ops cannot name (a getitem, a higher-order op).
        return None
    return KeepOut(op, localization.node, kept_out, from_strict=strict)


@dataclass
class Repair:
    """validate.repair=auto at work: the override, the first artifact's failure and report as
    validation wrote it, and the verdict of the artifact lowered again under the override."""

    keep_out: KeepOut
    first_failure: str
    first_report: dict[str, Any]
    # The lowering cache key of the first artifact (the job's `lower` key is the repaired one's).
    first_lower_key: str | None = None
    passed: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "override": self.keep_out.override,
            "op": self.keep_out.op,
            "node": self.keep_out.node,
            "passed": self.passed,
            "first": {
                "failure": self.first_failure,
                "lower_cache_key": self.first_lower_key,
                **self.first_report,
            },
        }

    def summary(self) -> dict[str, str]:
        """The summary's and MLflow tags' words for it."""
        verdict = {True: "passed", False: "failed", None: "not validated"}[self.passed]
        return {"override": self.keep_out.override, "first": "failed", "repaired": verdict}
