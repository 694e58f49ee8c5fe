"""Linear layers and embeddings whose weights are 4-bit or 8-bit codes per group of a row,
computed by PyTorch's own int4 matrix multiply for the CPU (`aten._weight_int4pack_mm_for_cpu`),
which eager PyTorch runs and AOTInductor compiles into its package as a call. CUDA's int4 matrix
multiply (`aten._weight_int4pack_mm`, tinygemm) computes the same (u - 8) * s + z from the same
scales and zeros, with the codes in tiles of its own (runtimes/int4_kernels.py: both layouts, and
the rewrite of a program for CUDA that AOTInductor's lowering and eager PyTorch on CUDA make).

The kernel takes a weight of 4-bit codes u in [0, 15] packed two to a byte, and per group of
`group` codes along a row a scale s and a zero z: w = (u - 8) * s + z. It is fast with bfloat16
activations, scales and zeros (on this project's CPUs 60 times its float32 path), so a layer here
rounds its input to bfloat16, multiplies, and widens the bfloat16 product back to the model's
dtype; the scales and zeros are kept in bfloat16. The codes are exact: a GGUF file's Q4_0, Q4_1
and Q4_K codes go in unchanged (value = code * scale + offset: u = code - lowest code,
z = offset + (8 + lowest code) * s), and Q8_0's int8 codes as two 4-bit planes, the high and the
low nibble of code + 128:

    q * s = 16 s * (high - 8) + s * (low - 8) + 8 s

What the bfloat16 scales and activations cost is quantization's, measured against the float
model (the file's own dequantized weights) on text.
"""

from __future__ import annotations

import torch

from exporter.config.quantize import INT4_KERNEL_GROUPS
from runtimes import int4_kernels
from runtimes.int4_kernels import ROW_BLOCK, codes_of, for_cuda

_COMPUTE = torch.bfloat16
# The int4 grid's ends drawn in from a group's min and max by these factors, the best kept; rows
# searched at a time.
_SHRINKS = torch.linspace(1.0, 0.7, 13).tolist()
_SEARCHED_ROWS = 1024


def holds(rows: int, cols: int, group: int) -> bool:
    """Whether the kernel takes a weight [rows, cols] in groups of `group`."""
    return group in INT4_KERNEL_GROUPS and cols % group == 0 and int4_kernels.holds(rows, cols)


class Int4Plane(torch.nn.Module):
    """One weight [out, in] of 4-bit codes in the kernel's packing, with its bfloat16 scales and
    zeros [in // group, out, 2]."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        super().__init__()
        self.group = codes.shape[1] // scale.shape[1]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(_COMPUTE))

    @property
    def shape(self) -> tuple[int, int]:
        rows, half = self.packed.shape
        return rows, half * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] in bfloat16 times the weight's transpose, in bfloat16 [n, out]: by CUDA's
        kernel where x is on a GPU (eager at the model's dtype, which the goldens run on the
        artifact's device), the CPU's elsewhere (what export traces)."""
        if x.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(
                x, self._cuda_tiles(), self.group, self.scales_and_zeros
            )
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_and_zeros
        )

    def _cuda_tiles(self) -> torch.Tensor:
        """The codes in CUDA's tiles, made once per device the plane is on: a plain attribute,
        neither a buffer nor in the state dict, so the exported program never holds it."""
        tiles = self.__dict__.get("_tiles")
        if tiles is None or tiles.device != self.packed.device:
            tiles = self.__dict__["_tiles"] = for_cuda(self.packed)
        return tiles

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The codes u [rows, in] (every row, or the rows `rows`), as stored."""
        return codes_of(self.packed, rows)

    def dequantized(self, rows: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
        """(u - 8) * s + z [rows, in] at `dtype` (float32: the kernel's own arithmetic; float64
        for the oracle: every factor widened, nothing rounded)."""
        return dequantized(self.packed, self.scales_and_zeros, rows, dtype)

    def scales(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and zeros [rows, in // group] in bfloat16."""
        return _scales(self.scales_and_zeros, rows)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


class PackedLinear(torch.nn.Module):
    """A linear layer whose weight is the sum of one plane (4-bit codes) or two (8-bit codes, as
    their high and low nibbles): the input in bfloat16, each plane's product in bfloat16, the sum
    at the input's dtype, plus the bias.

    A bfloat16 product is rounded to 8 bits: a next-token logit of 25 to the nearest 0.125, which
    flips the order of tokens nearer than that (on SmolLM2's text, one position in fifty, and a
    greedy answer at its first token). The output projection of an LM (`exact_top`) therefore
    computes its `exact_top` largest outputs of each row again at the input's dtype from its
    weight with the scales as they were given (`exact_scale`, `exact_offset`: a GGUF file's, not
    rounded to bfloat16), the rest as the kernel gives them: the tokens that decoding picks among
    are ranked as the weights rank them, at the price of a lookup of that many rows."""

    def __init__(
        self,
        planes: list[Int4Plane],
        bits: int,
        bias: torch.Tensor | None,
        exact: tuple[int, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`exact`: (how many outputs, the scale and the offset per group such that the weight
        is U * scale + offset, U the codes counted from 0: a plane's, or 16 * high + low)."""
        super().__init__()
        self.planes = torch.nn.ModuleList(planes)
        self.bits = bits
        self.out_features, self.in_features = planes[0].shape
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.exact_top = 0
        if exact is not None:
            top, scale, offset = exact
            self.exact_top = min(top, self.out_features)
            self.register_buffer("exact_scale", scale.to(torch.float32))
            self.register_buffer("exact_offset", offset.to(torch.float32))

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        bits: int,
        signed: bool,
        bias: torch.Tensor | None = None,
        exact_top: int = 0,
    ) -> PackedLinear:
        """value = codes * scale + offset per group: 4-bit codes (`signed`: in [-8, 7], else
        counted in [0, 15]) or 8-bit ones (signed), carried exactly; `exact_top`: an output
        projection's outputs ranked by the weight with these scales (the class docstring)."""
        codes = codes.to(torch.int32)
        if bits == 4:
            lowest = -8 if signed else 0
            zero = offset + (8 + lowest) * scale
            planes = [Int4Plane(codes - lowest, scale, zero)]
        elif bits == 8:
            lowest = -128
            counted = codes - lowest
            high = Int4Plane(counted >> 4, 16 * scale, torch.zeros_like(scale))
            low = Int4Plane(counted & 0x0F, scale, offset + 8 * scale)
            planes = [high, low]
        else:
            raise ValueError(f"a packed linear layer holds 4-bit or 8-bit codes, not {bits}-bit")
        exact = (exact_top, scale, offset + lowest * scale) if exact_top else None
        return cls(planes, bits, bias, exact)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bits: int,
        group: int,
        bias: torch.Tensor | None = None,
        exact_top: int = 0,
    ) -> PackedLinear:
        """`weight` rounded to codes: 4-bit asymmetric per group, its range narrowed where that
        lowers the group's squared error; 8-bit symmetric per group (llama.cpp's Q8_0)."""
        if bits == 4:
            codes, scale, zero = _int4_searched(weight.detach().to(torch.float32), group)
            return cls.from_codes(codes - 8, scale, zero, 4, True, bias, exact_top)
        codes, scale = _int8_symmetric(weight.detach().to(torch.float32), group)
        return cls.from_codes(codes, scale, torch.zeros_like(scale), 8, True, bias, exact_top)

    @property
    def group(self) -> int:
        return self.planes[0].group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        narrow = flat.to(_COMPUTE)
        out = self.planes[0].matmul(narrow).to(x.dtype)
        for plane in self.planes[1:]:
            out = out + plane.matmul(narrow).to(x.dtype)
        if self.exact_top:
            top = _largest(out, self.exact_top)
            rows = self.exact_rows(top.reshape(-1), dtype=x.dtype)
            exact = (rows.view(*top.shape, self.in_features) * flat.unsqueeze(1)).sum(-1)
            out = out.scatter(-1, top, exact)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, rows: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
        """The weight's `rows` (all by default) at `dtype`, as the kernel computes with it."""
        weight = self.planes[0].dequantized(rows, dtype)
        for plane in self.planes[1:]:
            weight = weight + plane.dequantized(rows, dtype)
        return weight

    def exact_rows(self, rows: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
        """The weight's `rows` at `dtype` with the scales as given (`exact_top`'s weight; the
        kernel's where there are none)."""
        if not self.exact_top:
            return self.dequantized(rows, dtype)
        counted = self.planes[0].codes(rows).to(torch.int32)
        for plane in self.planes[1:]:
            counted = counted * 16 + plane.codes(rows).to(torch.int32)
        scale, offset = self.exact_scale, self.exact_offset
        if rows is not None:
            scale, offset = scale[rows], offset[rows]
        scale, offset = (t.to(dtype).repeat_interleave(self.group, -1) for t in (scale, offset))
        return counted.to(dtype) * scale + offset

    def float64(self, x: torch.Tensor) -> torch.Tensor:
        """The layer in float64 for the oracle: the stored codes, scales and zeros widened (an
        output projection's scales as given, which rank its outputs)."""
        bias = None if self.bias is None else self.bias.to(torch.float64)
        return torch.nn.functional.linear(
            x.to(torch.float64), self.exact_rows(dtype=torch.float64), bias
        )

    def nbytes(self) -> int:
        found = sum(plane.nbytes() for plane in self.planes)
        if self.exact_top:
            found += self.exact_scale.nbytes + self.exact_offset.nbytes
        return found + (0 if self.bias is None else self.bias.nbytes)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group={self.group}"
        )


class PackedEmbedding(torch.nn.Module):
    """A token embedding that looks its rows up in a PackedLinear's weight: an output projection
    tied to the embedding keeps one table, as the file does; its rows are the weight with the
    scales as given where the projection keeps them (`PackedLinear.exact_rows`)."""

    def __init__(self, table: PackedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.exact_rows(ids.reshape(-1)).to(self.dtype)
        return rows.reshape(*ids.shape, self.table.in_features)

    def float64(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.exact_rows(ids.reshape(-1), dtype=torch.float64)
        return rows.reshape(*ids.shape, self.table.in_features)


def _largest(values: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the `count` largest of each row of `values` [n, out] (out a multiple of
    64), found among the blocks of 64 with the largest maxima: two small top-k of a few hundred
    values rather than one of the whole row, which AOTInductor's top-k takes five times as long
    over (0.24 ms over 49152 logits)."""
    rows, width = values.shape
    blocks = values.view(rows, width // ROW_BLOCK, ROW_BLOCK)
    best = blocks.amax(-1).topk(min(count, width // ROW_BLOCK), dim=-1).indices
    candidates = blocks.gather(1, best.unsqueeze(-1).expand(-1, -1, ROW_BLOCK))
    within = candidates.reshape(rows, -1).topk(count, dim=-1).indices
    block = best.gather(1, torch.div(within, ROW_BLOCK, rounding_mode="floor"))
    return block * ROW_BLOCK + within % ROW_BLOCK


def dequantized(
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    rows: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(u - 8) * s + z [rows, in] at `dtype` of a packed weight and its scales and zeros
    [in // group, out, 2]."""
    group = packed.shape[1] * 2 // scales_and_zeros.shape[0]
    codes = codes_of(packed, rows).to(dtype)
    scale, zero = (
        t.to(dtype).repeat_interleave(group, -1) for t in _scales(scales_and_zeros, rows)
    )
    return (codes - 8) * scale + zero


def int4pack_mm_float64(
    x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """`aten._weight_int4pack_mm_for_cpu` in float64, every factor widened (localization's
    float64 run of a program that calls it: exporter/quantize/float64_ops.py)."""
    weight = dequantized(packed, scales_and_zeros, dtype=torch.float64)
    return x.to(torch.float64) @ weight.T


def _scales(
    scales_and_zeros: torch.Tensor, rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    table = scales_and_zeros if rows is None else scales_and_zeros[:, rows]
    table = table.transpose(0, 1)
    return table[..., 0], table[..., 1]


def _int4_searched(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Codes in [0, 15], bfloat16-rounded scales and zeros of an asymmetric 4-bit grid per group,
    the grid's ends drawn in from the group's min and max where that gives a smaller squared
    error (the search llama.cpp's K-quants make): scales and zeros are rounded to bfloat16 before
    the codes are chosen, as the kernel reads them. A slice of rows at a time, whose temporaries
    stay in the CPU's caches (a 1B model's output projection is 262 M weights)."""
    rows, cols = weight.shape
    codes = torch.empty(rows, cols, dtype=torch.int32)
    scale = torch.empty(rows, cols // group)
    zero = torch.empty(rows, cols // group)
    for start in range(0, rows, _SEARCHED_ROWS):
        part = slice(start, start + _SEARCHED_ROWS)
        codes[part], scale[part], zero[part] = _int4_searched_rows(weight[part], group)
    return codes, scale, zero


def _int4_searched_rows(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    rows, cols = weight.shape
    grouped = weight.reshape(rows, cols // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    # The grid's centre stays the group's: shrinking draws both ends in.
    centre = (high + low) / 2
    best = None
    for shrink in _SHRINKS:
        scale = ((high - low) * shrink / 15).clamp(min=torch.finfo(torch.float32).tiny)
        scale = scale.to(_COMPUTE).to(torch.float32)
        zero = (centre + 0.5 * scale).to(_COMPUTE).to(torch.float32)
        error = (_grid(grouped, scale, zero) - grouped).square().sum(-1)
        if best is None:
            best = (scale, zero, error)
            continue
        better = error < best[2]
        found = (scale, zero, error)
        best = tuple(torch.where(better, new, old) for new, old in zip(found, best, strict=True))
    scale, zero, _ = best
    codes = _codes(grouped, scale, zero)
    return codes.reshape(rows, cols).to(torch.int32), scale, zero


def _codes(grouped: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round((grouped - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).clamp(0, 15)


def _grid(grouped: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The weights the kernel computes with, for codes chosen nearest to `grouped`."""
    return (_codes(grouped, scale, zero) - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)


def _int8_symmetric(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and bfloat16-rounded scales per group: scale = max |w| / 127."""
    rows, cols = weight.shape
    grouped = weight.reshape(rows, cols // group, group)
    scale = (grouped.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    scale = scale.to(_COMPUTE).to(torch.float32)
    codes = torch.round(grouped / scale.unsqueeze(-1)).clamp(-128, 127)
    return codes.reshape(rows, cols).to(torch.int32), scale
