"""Where each compute node of a lowered program runs and why: the partition an artifact carries.

The vocabulary is every backend's: a node runs in a delegate (by its backend id) or outside
every delegate (on the CPU for ExecuTorch, in PyTorch for TensorRT), and a node outside is there
because the backend does not support it, because the policy keeps
data-dependent output shapes off the backend, because the user named its op, or because its
block was smaller than `fallback.min_block_size`. A node whose op the delegate is known to compute
wrongly was rewritten before partitioning (`fallback.wrong_kernels=avoid`); the report lists
those nodes, what they became, and why. Whether `fallback=strict` holds of a partition is the
backends' verdict (exporter/backends/common/strict.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

CPU = "cpu"
PARTITION_FILE = "partition.json"

DELEGATED = "delegated"
UNSUPPORTED = "unsupported by the backend"
DATA_DEPENDENT = "data-dependent output shape"
NAMED = "named in fallback.ops"
SMALL_BLOCK = "block too small"


@dataclass(frozen=True)
class NodePlacement:
    node: str
    op: str
    # The delegate's backend id, or where a node outside runs: CPU for ExecuTorch's portable
    # kernels.
    placement: str
    reason: str
    # The backend's own words, where it gave some.
    detail: str = ""


@dataclass(frozen=True)
class WrongKernelAvoided:
    """A node of the exported program whose op the delegate computes as another function, and
    what lowering made of it instead."""

    node: str
    op: str
    # "rewritten into mul, tanh, add": what the delegate was given in its place.
    remedy: str
    # What the delegate's own kernel computes instead, as measured.
    why: str


@dataclass(frozen=True)
class PartitionSummary:
    nodes: tuple[NodePlacement, ...]
    delegates: int
    wrong_kernels_avoided: tuple[WrongKernelAvoided, ...] = ()

    @property
    def delegated_nodes(self) -> int:
        return sum(node.reason == DELEGATED for node in self.nodes)

    @property
    def delegated_fraction(self) -> float:
        return self.delegated_nodes / len(self.nodes) if self.nodes else 1.0

    @property
    def fallback_op_count(self) -> int:
        """Compute nodes outside every delegate."""
        return len(self.nodes) - self.delegated_nodes

    def ops_outside(self) -> dict[str, int]:
        """Op name -> how many of its nodes stayed outside every delegate, most frequent first."""
        counts = Counter(node.op for node in self.nodes if node.reason != DELEGATED)
        return dict(counts.most_common())

    def groups(self) -> list[tuple[str, str, str, str, int]]:
        """(placement, reason, op, detail, nodes), rows outside the delegates first, then by
        count."""
        counts = Counter((n.placement, n.reason, n.op, n.detail) for n in self.nodes)
        rows = [(*key, count) for key, count in counts.items()]
        return sorted(rows, key=lambda row: (row[1] == DELEGATED, row[1], -row[4], row[2]))

    def table(self) -> str:
        """One row per (where, why, op), then the backend's words for each reason given."""
        header = ("runs on", "why", "op", "nodes")
        counts = Counter((n.placement, n.reason, n.op) for n in self.nodes)
        ordered = sorted(
            counts.items(),
            key=lambda item: (item[0][1] == DELEGATED, item[0][1], -item[1], item[0][2]),
        )
        rows = [(placement, reason, op, str(n)) for (placement, reason, op), n in ordered]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]
        ]
        ops_by_detail: dict[str, set[str]] = {}
        for _, reason, op, detail, _ in self.groups():
            if reason != DELEGATED and detail:
                ops_by_detail.setdefault(detail, set()).add(op)
        if ops_by_detail:
            lines.append("in detail:")
            lines += [f"  {d}: {', '.join(sorted(ops))}" for d, ops in ops_by_detail.items()]
        if self.wrong_kernels_avoided:
            lines.append("wrong kernels avoided (fallback.wrong_kernels=avoid):")
            lines += [
                f"  {a.node} ({a.op}) {a.remedy}: {a.why}" for a in self.wrong_kernels_avoided
            ]
        return "\n".join(lines)

    def describe(self) -> str:
        return (
            f"{self.delegated_nodes} of {len(self.nodes)} compute nodes delegated "
            f"({self.delegated_fraction:.0%}) in {self.delegates} delegate calls; "
            f"{self.fallback_op_count} fall back\n{self.table()}"
        )

    def to_json(self) -> dict:
        return {
            "delegates": self.delegates,
            "compute_nodes": len(self.nodes),
            "delegated_nodes": self.delegated_nodes,
            "delegated_fraction": self.delegated_fraction,
            "fallback_op_count": self.fallback_op_count,
            "ops_outside": self.ops_outside(),
            "groups": [
                {"placement": p, "reason": r, "op": op, "detail": d, "nodes": n}
                for p, r, op, d, n in self.groups()
            ],
            "nodes": [asdict(node) for node in self.nodes],
            "wrong_kernels_avoided": [asdict(avoided) for avoided in self.wrong_kernels_avoided],
        }

    @classmethod
    def from_json(cls, payload: dict) -> PartitionSummary:
        nodes = tuple(NodePlacement(**node) for node in payload["nodes"])
        avoided = tuple(
            WrongKernelAvoided(**avoided) for avoided in payload.get("wrong_kernels_avoided", ())
        )
        return cls(nodes=nodes, delegates=payload["delegates"], wrong_kernels_avoided=avoided)
