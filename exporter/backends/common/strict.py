"""The `strict` fallback policy's verdict on a lowered artifact's partition: every compute node in
the backend's delegate, or the lowering fails naming each op left outside."""

from __future__ import annotations

from exporter.artifact.partition import DELEGATED, PartitionSummary
from exporter.config import FallbackConfig, FallbackPolicy
from exporter.errors import LoweringFailed


def enforce(summary: PartitionSummary, fallback: FallbackConfig, backend: str) -> None:
    """Raises LoweringFailed under `fallback=strict` if any compute node stayed outside."""
    if fallback.policy is not FallbackPolicy.strict or not summary.fallback_op_count:
        return
    listing = "\n".join(
        f"  {op} x{count}: {detail or reason}"
        for _, reason, op, detail, count in summary.groups()
        if reason != DELEGATED
    )
    raise LoweringFailed(
        f"fallback=strict: {summary.fallback_op_count} compute nodes would run outside the "
        f"{backend} delegate:\n{listing}\n"
        "Use fallback=auto (or data_dependent) to let them run outside it."
    )
