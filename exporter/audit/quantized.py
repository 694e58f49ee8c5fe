"""Quantized weights as the audit checks them: each of torchao's quantized weights (a tensor
subclass holding int8 `qdata` with int4 or int8 values, and a `scale` and `zero_point` per group
of `block_size` elements) is checked as its parts, each a plain tensor named `<weight>.<part>`.

The artifacts store the parts their own ways, which exporter/audit/matching.py's forms follow:
- a torch.export program keeps the subclass, read here into the same parts;
- AOTInductor stores each part under torch's parametrization name
  (`<module>.parametrizations.<attribute>.original<i>`, `i` the part's place in the subclass);
- XNNPACK keys int4 values packed two per byte (offset by 8, the even column in the low
  nibble), or int8 values as they are, by the SHA-256 of their bytes; scales by "scale_" and the
  SHA-256 of theirs, rounded to bfloat16 for per-group (int4) weights, float32 per channel. It
  stores no zero point: its kernels take 0, so the model's must be 0 (`implied_zero_points`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch

from exporter.audit.result import SHOWN, Checked, Mismatch

VALUES, SCALE, ZERO_POINT = "qdata", "scale", "zero_point"
# What a part is, in the audit's report.
_PART_NAMES = {VALUES: "values", SCALE: "scales", ZERO_POINT: "zero points"}


@dataclass(frozen=True)
class QuantizedPart:
    """One part of a quantized weight: which, of what, and the weight's groups."""

    weight: str  # the weight's fully qualified name
    part: str  # VALUES, SCALE or ZERO_POINT (torchao's attribute names)
    index: int  # its place among the subclass's tensors
    bits: int  # of the quantized values: 4 or 8
    block: tuple[int, int]  # the elements of the weight one scale covers (rows, columns)
    shape: tuple[int, int]  # the weight's

    @property
    def name(self) -> str:
        return f"{self.weight}.{self.part}"

    @property
    def stored_name(self) -> str:
        """Its name where torch unwraps the subclass into parametrizations (AOTInductor)."""
        module, _, attribute = self.weight.rpartition(".")
        prefix = f"{module}." if module else ""
        return f"{prefix}parametrizations.{attribute}.original{self.index}"

    @property
    def groups(self) -> tuple[int, int]:
        """The weight's groups, by rows and columns."""
        return self.shape[0] // self.block[0], self.shape[1] // self.block[1]

    def grouped(self, differs: torch.Tensor) -> torch.Tensor:
        """Which groups hold a differing element of this part (a mask of the part's shape)."""
        rows, columns = self.groups
        if self.part != VALUES:
            return differs.reshape(rows, columns)
        return differs.reshape(rows, self.block[0], columns, self.block[1]).any(dim=3).any(dim=1)

    def describe_group(self, row: int, group: int) -> str:
        """A group as the report names it: its row of groups and, where a row has several, its
        columns of the weight."""
        if self.groups[1] == 1:
            return f"row {row}"
        first = group * self.block[1]
        return f"row {row} group {group} (columns {first}-{first + self.block[1] - 1})"


def is_quantized(tensor: object) -> bool:
    """Whether the tensor is torchao's quantized weight with values, scales and zero points."""
    names = getattr(type(tensor), "tensor_data_names", ())
    return isinstance(tensor, torch.Tensor) and all(p in names for p in (VALUES, SCALE, ZERO_POINT))


def unpacked(
    weights: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedPart]]:
    """The weights with each quantized one replaced by its parts (plain tensors on the host),
    and what each part is, by the part's name."""
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, QuantizedPart] = {}
    for name, weight in weights.items():
        if not is_quantized(weight):
            tensors[name] = weight
            continue
        present = [p for p in type(weight).tensor_data_names if getattr(weight, p) is not None]
        bits = int(str(weight.target_dtype).removeprefix("torch.int").removeprefix("torch.uint"))
        block = tuple(int(b) for b in weight.block_size)
        for index, attribute in enumerate(present):
            if attribute not in _PART_NAMES:
                continue
            part = QuantizedPart(
                name, attribute, index, bits, (block[0], block[1]), tuple(weight.shape)
            )
            parts[part.name] = part
            tensors[part.name] = getattr(weight, attribute).detach().cpu()
    return tensors, parts


def implied_zero_points(
    parts: Mapping[str, QuantizedPart],
    tensors: Mapping[str, torch.Tensor],
    held: Collection[str],
    keyed: Collection[str],
    delegate: str,
) -> tuple[list[Checked], list[Mismatch]]:
    """XNNPACK stores no zero point (its quantized kernels take 0): a weight whose values its
    named data holds (`keyed`) and whose zero points no constant holds (not `held`) is checked
    as 0 in every group; a group whose zero point is not 0 computes otherwise there."""
    found_checked, found_mismatched = [], []
    where = f"{delegate}'s format (it stores no zero point: its kernels take 0)"
    for name, part in parts.items():
        if part.part != ZERO_POINT or name in held or f"{part.weight}.{VALUES}" not in keyed:
            continue
        zero_point = tensors[name]
        differs = zero_point != 0
        if not differs.any():
            found_checked.append(Checked(name, where, "0 in every group"))
            continue
        found_mismatched.append(
            grouped_mismatch(
                part,
                differs,
                zero_point.double().abs(),
                where=where,
                how="as 0",
                paired_by="the delegate's format",
            )
        )
    return found_checked, found_mismatched


def grouped_mismatch(
    part: QuantizedPart,
    differs: torch.Tensor,
    difference: torch.Tensor,
    where: str,
    how: str,
    paired_by: str,
) -> Mismatch:
    """A part's differing elements (`differs`, `difference`: of the part's shape), named by the
    weight's groups that hold them."""
    groups = part.grouped(differs)
    at = groups.nonzero()[:SHOWN].tolist()
    rows = differs.shape[0] if differs.dim() > 1 else 1
    return Mismatch(
        parameter=part.name,
        where=where,
        how=how,
        elements=differs.numel(),
        differing=int(differs.sum()),
        max_abs=float(difference[differs].max()) if differs.any() else 0.0,
        rows=rows,
        differing_rows=int(differs.reshape(rows, -1).any(dim=1).sum()),
        differing_at=(),
        paired_by=paired_by,
        groups=groups.numel(),
        differing_groups=int(groups.sum()),
        groups_at=tuple(part.describe_group(r, g) for r, g in at),
    )


def summary(
    parts: Mapping[str, QuantizedPart], checked: Iterable[Checked]
) -> dict[str, object] | None:
    """How many quantized weights (and groups) the audit checked whole, and how each part was
    compared; None without quantized weights."""
    if not parts:
        return None
    how: dict[str, set[str]] = {}
    seen: set[str] = set()
    for c in checked:
        part = parts.get(c.parameter)
        if part is not None:
            seen.add(c.parameter)
            how.setdefault(_PART_NAMES[part.part], set()).add(c.how)
    weights: dict[str, list[QuantizedPart]] = {}
    for part in parts.values():
        weights.setdefault(part.weight, []).append(part)
    whole = [w for w, ps in weights.items() if all(p.name in seen for p in ps)]
    groups = sum(weights[w][0].groups[0] * weights[w][0].groups[1] for w in whole)
    return {
        "weights": len(weights),
        "checked": len(whole),
        "groups": groups,
        "compared": {part: sorted(ways) for part, ways in how.items()},
    }
