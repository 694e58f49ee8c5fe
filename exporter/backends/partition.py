"""Where each compute node of a lowered program runs, and the fallback policy applied to it."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from exporter.config import FallbackConfig, FallbackPolicy
from exporter.errors import LoweringFailed

CPU = "cpu"
PARTITION_FILE = "partition.json"


@dataclass(frozen=True)
class NodePlacement:
    node: str
    op: str
    # The delegate's backend id, or CPU for a node left on the portable kernels.
    placement: str


@dataclass(frozen=True)
class PartitionSummary:
    nodes: tuple[NodePlacement, ...]
    delegates: int

    @property
    def delegated_nodes(self) -> int:
        return sum(node.placement != CPU for node in self.nodes)

    @property
    def delegated_fraction(self) -> float:
        return self.delegated_nodes / len(self.nodes) if self.nodes else 1.0

    def ops_outside(self) -> dict[str, int]:
        """Op name -> how many of its nodes stayed outside every delegate, most frequent first."""
        counts = Counter(node.op for node in self.nodes if node.placement == CPU)
        return dict(counts.most_common())

    def describe(self) -> str:
        outside = self.ops_outside()
        lines = [
            f"{self.delegated_nodes} of {len(self.nodes)} compute nodes delegated "
            f"({self.delegated_fraction:.0%}) in {self.delegates} delegate calls"
        ]
        if outside:
            lines.append(
                "outside the delegate: " + ", ".join(f"{op} x{n}" for op, n in outside.items())
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "delegates": self.delegates,
            "compute_nodes": len(self.nodes),
            "delegated_nodes": self.delegated_nodes,
            "delegated_fraction": self.delegated_fraction,
            "ops_outside": self.ops_outside(),
            "nodes": [asdict(node) for node in self.nodes],
        }

    @classmethod
    def from_json(cls, payload: dict) -> PartitionSummary:
        nodes = tuple(NodePlacement(**node) for node in payload["nodes"])
        return cls(nodes=nodes, delegates=payload["delegates"])


def enforce(summary: PartitionSummary, fallback: FallbackConfig, backend: str) -> None:
    """Raises LoweringFailed under `fallback=strict` if any compute node stayed outside."""
    outside = summary.ops_outside()
    if fallback.policy is FallbackPolicy.strict and outside:
        listing = "\n".join(f"  {op} x{count}" for op, count in outside.items())
        raise LoweringFailed(
            f"fallback=strict: {sum(outside.values())} compute nodes would run outside the "
            f"{backend} delegate:\n{listing}\n"
            "Use fallback=auto to run them on the portable CPU kernels."
        )
