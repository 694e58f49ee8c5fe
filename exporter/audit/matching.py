"""Ties the constants an artifact carries to the model's parameters and compares them.

A constant is tied to a parameter three ways, strongest first:

- by name: the format keys it by the parameter's fully qualified name (ExecuTorch's .ptd,
  AOTInductor's weights, a torch.export program): compared with that parameter;
- by key: the format keys it by the SHA-256 of the bytes it serialized (XNNPACK's and Vulkan's
  named data): bytes that still hash to their key are unchanged since lowering, and the key is
  the hash of one of the parameter's forms (below) where the constant is that parameter, so a
  constant that no longer hashes to its key is named by its key;
- by content: an unnamed constant (a .pte's constant buffer, a Vulkan payload's own bytes) whose
  bytes hash as one of a parameter's forms holds that parameter.

A form is the parameter as a backend may store it: as is, cast (float32 for a half-precision
weight XNNPACK computes in float32, int32 for an int64 one Vulkan downcasts), transposed (2-D),
or channels-last (a 4-D convolution weight XNNPACK stores NHWC). A quantized weight is matched
as its parts (exporter/audit/quantized.py), whose forms are their own: int4 values packed two
per byte, scales rounded to bfloat16 (XNNPACK's per-group scales). A weight of PyTorch's int4
kernel for the CPU may be stored in the tiles of CUDA's (AOTInductor on CUDA repacks it:
runtimes/int4_kernels.py), under its own name or beside it under
`int4_kernels.CUDA_SUFFIX`: a permutation of its 4-bit codes. Every comparison is exact: each
form is a cast that rounds nothing a backend did not round itself, or a permutation.

What is left then, parameters that no constant holds and unnamed constants that hold no
parameter, is paired by dtype and shape (under one of the parameter's forms), and only where
that cannot be mistaken: where a dtype and shape has as many parameters left as constants, in
order (one and one, or a program's constants, which ExecuTorch emits in its signature's order:
the parameters'); otherwise each parameter with the one constant that agrees with it on most
elements, over half of them. Scalars and constants under an intact key are never paired: they
are the backend's own (a folded eps, a mask), and a false mismatch would fail a correct
artifact; a parameter no constant is paired with is reported unseen.
"""

from __future__ import annotations

import hashlib
import math
import mmap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from exporter.audit import quantized
from exporter.audit.quantized import SCALE, VALUES, QuantizedPart
from exporter.audit.result import SHOWN, Checked, Corrupted, Mismatch, Unseen
from runtimes import int4_kernels

# A constant an unexplained one is paired with by agreement must agree on more than this.
_MOST_AGREE = 0.5


@dataclass(frozen=True)
class Constant:
    """One constant the artifact carries: its bytes and what the format says of them."""

    where: str
    data: bytes | memoryview
    dtype: torch.dtype | None = None  # None where the format does not say (XNNPACK's data)
    shape: tuple[int, ...] | None = None
    name: str | None = None  # the parameter's fully qualified name, where the format keys by it
    key: str | None = None  # the SHA-256 (hex) of its bytes, where the format keys by it

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Form:
    """The parameter as a backend may store it: cast to `dtype`, its dims permuted, or (int4
    values of a quantized weight) packed two per byte as XNNPACK packs them."""

    dtype: torch.dtype
    permutation: tuple[int, ...] | None
    packed: bool = False
    cuda_tiles: bool = False

    def describe(self, parameter: torch.Tensor) -> str:
        """The transformation, e.g. "float32 cast, transpose"; empty for the parameter as is."""
        steps = []
        if self.cuda_tiles:
            steps.append("int4 repacked in CUDA's tiles")
        elif self.packed:
            steps.append("int4 packed two per byte, offset by 8")
        elif self.dtype != parameter.dtype and _rounds(parameter.dtype, self.dtype):
            steps.append(f"rounded to {str(self.dtype).removeprefix('torch.')}")
        elif self.dtype != parameter.dtype:
            steps.append(f"{str(self.dtype).removeprefix('torch.')} cast")
        if self.permutation == (1, 0):
            steps.append("transpose")
        elif self.permutation is not None:
            steps.append(f"permuted {self.permutation} (channels-last)")
        return ", ".join(steps)

    def apply(self, parameter: torch.Tensor) -> torch.Tensor:
        if self.cuda_tiles:
            # By CUDA's own packing where a GPU is, as the lowering packed it.
            device = "cuda" if torch.cuda.is_available() else "cpu"
            return int4_kernels.for_cuda(parameter.detach().to(device)).cpu()
        value = parameter.detach().cpu()
        if self.packed:
            return _packed_int4(value)
        value = value.to(self.dtype)
        if self.permutation is not None:
            value = value.permute(self.permutation)
        return value.contiguous()

    def unstored(self, stored: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
        """The stored tensor (of this form's shape) back in the parameter's layout, in this
        form's dtype (unpacked values in the parameter's)."""
        if self.cuda_tiles:
            rows, half = parameter.shape
            return int4_kernels.from_cuda(stored, rows, half * 2)
        if self.packed:
            low, high = (stored & 0xF).to(torch.int8) - 8, (stored >> 4).to(torch.int8) - 8
            return torch.stack((low, high), dim=-1).reshape(stored.shape[0], -1)[
                :, : parameter.shape[1]
            ]
        if self.permutation is None:
            return stored
        inverse = tuple(sorted(range(len(self.permutation)), key=self.permutation.__getitem__))
        return stored.permute(inverse)

    def cast(self, parameter: torch.Tensor) -> torch.Tensor:
        """The parameter in its own layout, in the dtype `unstored` gives."""
        value = parameter.detach().cpu()
        return value if self.packed or self.cuda_tiles else value.to(self.dtype)

    def shape(self, parameter: torch.Tensor) -> tuple[int, ...]:
        dims = tuple(parameter.shape)
        if self.cuda_tiles:
            return int4_kernels.cuda_shape(dims[0], dims[1] * 2)
        if self.packed:
            return dims[0], (dims[1] + 1) // 2
        return tuple(dims[d] for d in self.permutation) if self.permutation else dims

    def nbytes(self, parameter: torch.Tensor) -> int:
        return math.prod(self.shape(parameter)) * self.dtype.itemsize


def _rounds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    return wide.is_floating_point and narrow.is_floating_point and narrow.itemsize < wide.itemsize


def _packed_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values (in int8) packed as XNNPACK stores them: offset by 8 into 0..15, two per
    byte, the even column in the low nibble; an odd row padded with a 0 value."""
    if values.shape[1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    # In int8: values in -8..7 plus 8 stay in range, and a 1B model's head is no wider copy.
    offset = (values + 8).view(torch.uint8)
    return (offset[:, 1::2] << 4 | offset[:, 0::2]).contiguous()


def forms(parameter: torch.Tensor, part: QuantizedPart | None = None) -> list[Form]:
    """The forms a backend may store the parameter in; a quantized weight's part has its own:
    int4 values as they are or packed, scales as they are or rounded to bfloat16 (XNNPACK's
    per-group scales), zero points as they are."""
    if part is not None:
        found = [Form(parameter.dtype, None)]
        if part.part == VALUES and part.bits == 4:
            found.append(Form(torch.uint8, None, packed=True))
        if part.part == SCALE and parameter.dtype != torch.bfloat16:
            found.append(Form(torch.bfloat16, None))
        return found
    dtypes = [parameter.dtype]
    if parameter.is_floating_point() and parameter.dtype != torch.float32:
        dtypes.append(torch.float32)
    if parameter.dtype == torch.int64:
        dtypes.append(torch.int32)
    permutations: list[tuple[int, ...] | None] = [None]
    if parameter.dim() == 2:
        permutations.append((1, 0))
    if parameter.dim() == 4:
        permutations.append((0, 2, 3, 1))
    found = [Form(d, p) for d in dtypes for p in permutations]
    if _int4_packing_for_cpu(parameter):
        found.append(Form(torch.int32, None, cuda_tiles=True))
    return found


def _int4_packing_for_cpu(parameter: torch.Tensor) -> bool:
    """Whether the parameter could be codes in the CPU int4 kernel's packing [out, in // 2]
    (rows in its blocks, a row of whole groups: int4_kernels.holds)."""
    return (
        parameter.dtype == torch.uint8
        and parameter.dim() == 2
        and int4_kernels.holds(parameter.shape[0], parameter.shape[1] * 2)
    )


def fits(constant: Constant, form: Form, parameter: torch.Tensor) -> bool:
    """Whether the constant could be the parameter in this form. A constant of unknown shape
    (XNNPACK's) is taken as the parameter's own layout or channels-last, never a transpose,
    which XNNPACK does not make."""
    if constant.nbytes != form.nbytes(parameter):
        return False
    if constant.dtype is not None and constant.dtype != form.dtype:
        return False
    if constant.shape is not None:
        return tuple(constant.shape) == form.shape(parameter)
    return form.permutation != (1, 0)


def sha256(data: bytes | memoryview | torch.Tensor) -> str:
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Matched:
    """What tying an artifact's constants to the weights found, and the quantized weights' parts
    (by the part's name) that the weights were checked as."""

    checked: list[Checked]
    mismatched: list[Mismatch]
    unseen: list[Unseen]
    corrupted: list[Corrupted]
    parts: dict[str, QuantizedPart]


def audit_constants(
    constants: Iterable[Constant],
    weights: Mapping[str, torch.Tensor],
    why_unseen: Callable[[str, torch.Tensor], str],
    no_zero_points: str | None = None,
) -> Matched:
    """Ties `constants` to `weights` (a quantized weight: to its parts) and compares them; a
    weight or part no constant holds is unseen, `why_unseen(name, tensor)` says why.
    `no_zero_points`: the delegate whose named data holds quantized values without zero points
    (its kernels take 0), where a quantized weight's zero points are then checked as 0."""
    constants = list(constants)
    tensors, parts = quantized.unpacked(weights)
    stored_names = {part.stored_name: name for name, part in parts.items()}
    checked: dict[str, Checked] = {}
    mismatched: dict[str, Mismatch] = {}
    corrupted: list[Corrupted] = []
    hashes = _FormHashes(tensors, parts, constants)
    # Tied to a constant of a delegate's named data (by its key).
    keyed: set[str] = set()

    unexplained: list[Constant] = []
    for constant in constants:
        name = stored_names.get(constant.name or "", constant.name)
        if name is not None and name not in tensors:
            name = name.removesuffix(int4_kernels.CUDA_SUFFIX)
        if name is not None and name in tensors:
            _compare_named(name, constant, tensors[name], parts.get(name), checked, mismatched)
            _pages_released(constant.data)
            continue
        content = sha256(constant.data)
        _pages_released(constant.data)
        if constant.key is not None and content != constant.key:
            holders = hashes.holders(constant.key, constant)
            for held, form in holders:
                keyed.add(held)
                mismatched.setdefault(
                    held,
                    _compared(held, tensors[held], form, constant, "key", parts.get(held)),
                )
            if not holders:
                corrupted.append(Corrupted(constant.where, constant.nbytes))
            continue
        holders = hashes.holders(content, constant)
        for held, form in holders:
            checked.setdefault(held, _checked(held, constant, form, tensors[held]))
            if constant.key is not None:
                keyed.add(held)
        # A constant under its intact key that is no parameter's is the backend's own (a
        # mask, a folded value); only an unkeyed one may be a parameter whose bytes changed.
        if not holders and constant.key is None and _numel(constant) > 1:
            unexplained.append(constant)

    for name in checked.keys() & mismatched.keys():
        del checked[name]
    missing = [n for n in tensors if n not in checked and n not in mismatched]
    for name, constant, form, paired_by in _paired(missing, unexplained, tensors, parts):
        mismatched[name] = _compared(
            name, tensors[name], form, constant, paired_by, parts.get(name)
        )
    if no_zero_points is not None:
        held = checked.keys() | mismatched.keys()
        implied = quantized.implied_zero_points(parts, tensors, held, keyed, no_zero_points)
        checked.update((c.parameter, c) for c in implied[0])
        mismatched.update((m.parameter, m) for m in implied[1])
    unseen = [
        Unseen(n, why_unseen(n, t))
        for n, t in tensors.items()
        if n not in checked and n not in mismatched
    ]
    return Matched(list(checked.values()), list(mismatched.values()), unseen, corrupted, parts)


def _pages_released(data: bytes | memoryview) -> None:
    """Takes the pages of a mapped file that reading `data` brought in out of the process's
    resident memory (the file stays mapped; what is read again is read from the page cache).
    The readers map the artifact's files: reading a 6 GB .pte through its mapping otherwise
    kept all 6 GB resident beside the model's weights until the audit ended."""
    mapping = data.obj if isinstance(data, memoryview) else None
    if isinstance(mapping, mmap.mmap):
        mapping.madvise(mmap.MADV_DONTNEED)


def _numel(constant: Constant) -> int:
    return math.prod(constant.shape) if constant.shape is not None else constant.nbytes


class _FormHashes:
    """The SHA-256 of each parameter's forms that some constant could be (same size, dtype and
    shape), computed once: a hash to the (parameter, form) pairs that make it."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        parts: Mapping[str, QuantizedPart],
        constants: list[Constant],
    ) -> None:
        self.weights = weights
        by_size: dict[int, list[Constant]] = {}
        for constant in constants:
            by_size.setdefault(constant.nbytes, []).append(constant)
        self.index: dict[str, list[tuple[str, Form]]] = {}
        for name, parameter in weights.items():
            for form in forms(parameter, parts.get(name)):
                candidates = by_size.get(form.nbytes(parameter), ())
                if any(fits(c, form, parameter) for c in candidates):
                    digest = sha256(form.apply(parameter))
                    self.index.setdefault(digest, []).append((name, form))

    def holders(self, digest: str, constant: Constant) -> list[tuple[str, Form]]:
        found = self.index.get(digest, [])
        return [(n, f) for n, f in found if fits(constant, f, self.weights[n])]


def _compare_named(
    name: str,
    constant: Constant,
    parameter: torch.Tensor,
    part: QuantizedPart | None,
    checked: dict[str, Checked],
    mismatched: dict[str, Mismatch],
) -> None:
    fitting = [f for f in forms(parameter, part) if fits(constant, f, parameter)]
    if not fitting:
        mismatched[name] = Mismatch(
            name,
            constant.where,
            f"holds {constant.nbytes} bytes of {constant.dtype} {constant.shape}, not the "
            f"parameter's {parameter.dtype} {tuple(parameter.shape)} in any form",
            parameter.numel(),
            parameter.numel(),
            float("nan"),
            _rows(parameter),
            _rows(parameter),
            (),
            "name",
        )
        return
    for form in fitting:
        if sha256(constant.data) == sha256(form.apply(parameter)):
            checked.setdefault(name, _checked(name, constant, form, parameter))
            return
    mismatched[name] = _compared(name, parameter, fitting[0], constant, "name", part)


def _paired(
    missing: list[str],
    unexplained: list[Constant],
    weights: Mapping[str, torch.Tensor],
    parts: Mapping[str, QuantizedPart],
) -> list[tuple[str, Constant, Form, str]]:
    """Pairs parameters no constant holds with unexplained constants of their dtype and shape
    (under one of their forms): in order where a dtype and shape has as many of one as of the
    other (ExecuTorch emits a program's constants in its signature's order, the parameters'),
    else each parameter with the constant that agrees with it on most elements, over half."""
    groups: dict[tuple[torch.dtype | None, tuple[int, ...]], tuple[list, list[Constant]]] = {}
    for constant in unexplained:
        if constant.shape is not None:
            groups.setdefault((constant.dtype, tuple(constant.shape)), ([], []))[1].append(constant)
    for name in missing:
        parameter = weights[name]
        for form in forms(parameter, parts.get(name)):
            group = groups.get((form.dtype, form.shape(parameter)))
            if group is not None:
                group[0].append((name, form))
                break
    pairs: list[tuple[str, Constant, Form, str]] = []
    for named, constants in groups.values():
        if len(named) == len(constants):
            how = "shape" if len(named) == 1 else "shape and order"
            pairs += [(n, c, f, how) for (n, f), c in zip(named, constants, strict=True)]
            continue
        free = list(constants)
        for name, form in named:
            agreement = sorted(
                ((_agreement(weights[name], form, c), i) for i, c in enumerate(free)),
                reverse=True,
            )
            if not agreement or agreement[0][0] <= _MOST_AGREE:
                continue
            if len(agreement) > 1 and agreement[1][0] == agreement[0][0]:
                continue
            pairs.append((name, free.pop(agreement[0][1]), form, "closest of its shape"))
    return pairs


def _decoded(constant: Constant, form: Form, parameter: torch.Tensor) -> torch.Tensor:
    """The constant's bytes in the parameter's layout, in the form's dtype (a copy: the
    artifact's mapping is read-only)."""
    raw = torch.frombuffer(bytearray(constant.data), dtype=torch.uint8)
    return form.unstored(raw.view(form.dtype).reshape(form.shape(parameter)), parameter)


def _agreement(parameter: torch.Tensor, form: Form, constant: Constant) -> float:
    got, want = _decoded(constant, form, parameter), form.cast(parameter)
    return float((_same(got, want)).float().mean()) if want.numel() else 1.0


def _same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    equal = got == want
    if want.is_floating_point():
        equal |= got.isnan() & want.isnan()
    return equal


def _checked(name: str, constant: Constant, form: Form, parameter: torch.Tensor) -> Checked:
    return Checked(name, constant.where, form.describe(parameter) or "exact")


def _compared(
    name: str,
    parameter: torch.Tensor,
    form: Form,
    constant: Constant,
    paired_by: str,
    part: QuantizedPart | None = None,
) -> Mismatch:
    got, want = _decoded(constant, form, parameter), form.cast(parameter)
    differs = ~_same(got, want)
    difference = (got.double() - want.double()).abs()
    how = form.describe(parameter) or "as is"
    if part is not None:
        return quantized.grouped_mismatch(part, differs, difference, constant.where, how, paired_by)
    rows = _rows(parameter)
    row_differs = differs.reshape(rows, -1).any(dim=1)
    # Named by row, or by element in a vector or scalar.
    named = row_differs if rows > 1 else differs.reshape(-1)
    return Mismatch(
        parameter=name,
        where=constant.where,
        how=how,
        elements=parameter.numel(),
        differing=int(differs.sum()),
        max_abs=float(difference[differs].max()) if differs.any() else 0.0,
        rows=rows,
        differing_rows=int(row_differs.sum()),
        differing_at=tuple(named.nonzero().reshape(-1)[:SHOWN].tolist()),
        paired_by=paired_by,
    )


def _rows(parameter: torch.Tensor) -> int:
    """Rows along the first dim of a matrix or higher; a vector or scalar is one row."""
    return parameter.shape[0] if parameter.dim() > 1 else 1
