"""What a weights audit found: each parameter checked, mismatched or unseen, and where."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Checked:
    parameter: str
    where: str  # e.g. "XNNPACK named data 9c5dc25dabbb…"
    how: str  # "exact", or the transformation: "float32 cast", "transpose", ...


# How many differing rows (or elements) a mismatch names.
SHOWN = 8


@dataclass(frozen=True)
class Mismatch:
    """A constant of the artifact that holds the parameter (so its key or name says), with other
    values."""

    parameter: str
    where: str
    how: str  # the transformation assumed when comparing, or "as is"
    elements: int
    differing: int
    max_abs: float
    # Along the first dim of a parameter of 2 dims or more (an embedding's tokens, a linear's
    # output features); 1 for a vector or a scalar.
    rows: int
    differing_rows: int
    # Where they differ: the first `SHOWN` differing rows (elements of a vector), in order; empty
    # where the constant holds another shape altogether.
    differing_at: tuple[int, ...]
    # How the constant was tied to the parameter: "name" (it is stored under the parameter's
    # name), "key" (under the SHA-256 of the parameter's bytes), "shape" (the one constant of
    # its shape and dtype left unexplained) or "closest of its shape".
    paired_by: str
    # A quantized weight's part (values, scales or zero points): the weight's groups (one scale
    # and zero point each), how many hold a differing element, and the first `SHOWN` of them.
    groups: int = 0
    differing_groups: int = 0
    groups_at: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.groups:
            return self._describe_groups()
        rows = (
            f"{self.differing_rows} of {self.rows} rows differ ({self.differing} of "
            f"{self.elements} elements)"
            if self.rows > 1
            else f"{self.differing} of {self.elements} elements differ"
        )
        return (
            f"{self.parameter}: {rows}{self._where_they_differ()}, max abs {self.max_abs:.4g}; "
            f"at {self.where} (compared {self.how}, paired by {self.paired_by})"
        )

    def _describe_groups(self) -> str:
        shown = "; ".join(self.groups_at)
        more = self.differing_groups - len(self.groups_at)
        return (
            f"{self.parameter}: {self.differing_groups} of {self.groups} groups differ "
            f"({self.differing} of {self.elements} elements): {shown}"
            + (f" and {more} more" if more > 0 else "")
            + f", max abs {self.max_abs:.4g}; at {self.where} (compared {self.how}, paired by "
            f"{self.paired_by})"
        )

    def _where_they_differ(self) -> str:
        if not self.differing_at:
            return ""
        by_row = self.rows > 1
        unit, count = ("rows", self.differing_rows) if by_row else ("elements", self.differing)
        shown = ", ".join(str(i) for i in self.differing_at)
        more = count - len(self.differing_at)
        return f": {unit} {shown}" + (f" and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class Unseen:
    parameter: str
    why: str


@dataclass(frozen=True)
class Corrupted:
    """A constant whose bytes no longer hash to the key it is stored under, and whose key is no
    parameter's: changed after lowering, but not traceable to a parameter."""

    where: str
    nbytes: int


@dataclass(frozen=True)
class WeightsAudit:
    runtime: str
    read: str  # what of the artifact the audit read, in a sentence
    checked: tuple[Checked, ...]
    mismatched: tuple[Mismatch, ...]
    unseen: tuple[Unseen, ...]
    corrupted: tuple[Corrupted, ...] = ()
    # The buffers skipped as state the program writes as it runs (a KV cache), not weights.
    state: tuple[str, ...] = ()
    # Of the quantized weights, each checked as its parts (values, scales, zero points): how
    # many there are, how many had every part checked, their groups, and how each part was
    # compared ("compared": part to the ways); None without quantized weights.
    quantized: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        """Unseen parameters do not fail the audit (the report names them); a mismatch does,
        and so does a constant that no longer hashes to its key."""
        return not self.mismatched and not self.corrupted

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "runtime": self.runtime,
            "read": self.read,
            "checked": len(self.checked),
            "mismatched": [
                {
                    "parameter": m.parameter,
                    "where": m.where,
                    "how": m.how,
                    "elements": m.elements,
                    "differing": m.differing,
                    "rows": m.rows,
                    "differing_rows": m.differing_rows,
                    "differing_at": list(m.differing_at),
                    "max_abs": m.max_abs,
                    "paired_by": m.paired_by,
                    **(
                        {
                            "groups": m.groups,
                            "differing_groups": m.differing_groups,
                            "groups_at": list(m.groups_at),
                        }
                        if m.groups
                        else {}
                    ),
                }
                for m in self.mismatched
            ],
            "unseen": [u.parameter for u in self.unseen],
            "unseen_why": {u.parameter: u.why for u in self.unseen},
            "skipped_state": list(self.state),
            "corrupted": [{"where": c.where, "nbytes": c.nbytes} for c in self.corrupted],
            "checked_at": {c.parameter: f"{c.where} ({c.how})" for c in self.checked},
            "quantized": self.quantized,
        }

    def lines(self) -> list[str]:
        verdict = "passed" if self.passed else "FAILED"
        lines = [
            f"weights audit {verdict}: {len(self.checked)} checked, {len(self.mismatched)} "
            f"mismatched, {len(self.unseen)} unseen"
            + (f", {len(self.state)} state buffers skipped" if self.state else "")
            + f" ({self.read})"
        ]
        if self.quantized:
            lines.append(f"  quantized: {_quantized_line(self.quantized)}")
        if self.state:
            lines.append(
                f"  skipped: {_shown(self.state)}: the KV cache's buffers, state the program "
                "writes as it runs, not weights"
            )
        lines += [f"  mismatch: {m.describe()}" for m in self.mismatched]
        lines += [
            f"  corrupted: {c.where} ({c.nbytes} bytes) no longer hashes to its key"
            for c in self.corrupted
        ]
        by_reason: dict[str, list[str]] = {}
        for u in self.unseen:
            by_reason.setdefault(u.why, []).append(u.parameter)
        for why, names in by_reason.items():
            lines.append(f"  unseen: {_shown(names)}: {why}")
        return lines


def _shown(names: Sequence[str]) -> str:
    """The first four names, and how many more."""
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _quantized_line(found: dict[str, Any]) -> str:
    """How many quantized weights (and groups) were checked whole, and how each part was
    compared: bit for bit, in the form (and at the precision) the artifact stores it."""
    compared = "; ".join(
        f"{part} {', '.join(_precision(way) for way in ways)}"
        for part, ways in found["compared"].items()
    )
    return (
        f"{found['checked']} of {found['weights']} quantized weights checked in values, scales "
        f"and zero points ({found['groups']} groups), bit for bit as the artifact stores them"
        + (f": {compared}" if compared else "")
    )


def _precision(way: str) -> str:
    if way.startswith("rounded to"):
        return f"{way} (the format's precision: the model's rounded alike, then compared)"
    return way
