"""PyTorch's int4 matrix multiply, on the CPU (`aten._weight_int4pack_mm_for_cpu`) and on CUDA
(`aten._weight_int4pack_mm`, tinygemm): the layouts each reads its 4-bit codes in, and the
rewrite of a program for CUDA. Both compute (u - 8) * s + z from the same scales and zeros
[in // group, out, 2], so a program of the CPU's kernel (the packed layers of
exporter/quantize/packed.py) computes what it did with CUDA's, each weight repacked into CUDA's
tiles: its 4-bit weights read as 4 bits, where a dequantize-then-matmul reads the codes and then
the whole weight at bfloat16. AOTInductor's lowering for CUDA compiles the rewritten program
(a package with a decode step gives its prompts to cuBLAS: `prompts_through_cublas`); eager
PyTorch on CUDA (runtimes/loaders/eager.py) runs it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

# Rows of a weight the kernels take come in whole blocks of this many: each CPU packing's block
# divides it (`cpu_packing`), and so do CUDA's tiles of 8 rows.
ROW_BLOCK = 64
# The name of a weight repacked for CUDA beside the CPU packing it came from, where the program
# still reads that packing (an output projection's exact rows, a tied embedding's lookup).
CUDA_SUFFIX = "_for_cuda"
# Where an artifact that calls the CPU kernel records the packing its weights are in (an
# AOTInductor package's metadata, a program file's extra files): another CPU's kernel would read
# them wrong, silently.
PACKING_KEY = "cpu_int4_packing"
_CPU_KERNEL = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_CUDA_KERNEL = torch.ops.aten._weight_int4pack_mm.default


def holds(rows: int, cols: int) -> bool:
    """Whether both kernels take a weight of `rows` by `cols` codes (in groups of 32 or more)."""
    return rows % ROW_BLOCK == 0 and cols % 32 == 0


@dataclass(frozen=True)
class CpuPacking:
    """How the CPU kernel packs codes on this machine, which depends on the CPU's vector width
    (PyTorch's aten/src/ATen/native/cpu/int4mm_kernel.cpp): rows in blocks of `block`, a
    block's bytes running along K, `block // 2` bytes a column; byte j of a column holds rows j
    and j + block // 2 of the block (`halves`: AVX512, blocks of 64; AVX2, blocks of 32) or
    rows 2j and 2j + 1 (without vector instructions, blocks of 32), the first in the low
    nibble. A weight packed on a machine of one packing computes garbage on another."""

    name: str
    block: int
    halves: bool

    def layout(self) -> str:
        """The packing as an artifact records it: its layout, whatever the CPU is called."""
        return f"{self.block}-row blocks, {'halves' if self.halves else 'pairs'}"


def cpu_packing() -> CpuPacking:
    """This machine's packing (`CPU_PACKING`); RuntimeError where it is none of the forms above
    (blocks of 64, 32 or 16)."""
    if CPU_PACKING is None:
        raise RuntimeError(
            "PyTorch's int4 kernel packs codes on this CPU "
            f"({torch.backends.cpu.get_cpu_capability()}) in a layout this project does not "
            "read; int4_weight needs a CPU with AVX512, AVX2 or no vector unit"
        )
    return CPU_PACKING


def _packing_read() -> CpuPacking | None:
    """The packing, found as the form under which `_codes_in` reads back codes that the kernel
    packed; None where no form does."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4 * ROW_BLOCK, 2), dtype=torch.int32, generator=generator)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    capability = torch.backends.cpu.get_cpu_capability()
    for block in (64, 32, 16):
        for halves in (True, False):
            packing = CpuPacking(capability, block, halves)
            if torch.equal(_codes_in(packed, packing).to(torch.int32), codes):
                return packing
    return None


def packing_record(program: ExportedProgram) -> dict[str, str]:
    """What an artifact of `program` records of the packing its weights are in (`PACKING_KEY`:
    this machine's), where the program calls the CPU kernel; nothing where it does not (CUDA's
    tiles, and codes that plain ops unpack, read alike on every machine)."""
    if not any(node.target is _CPU_KERNEL for node in program.graph.nodes):
        return {}
    return {PACKING_KEY: cpu_packing().layout()}


def require_packing(recorded: str | None, artifact: Path) -> None:
    """ValueError naming `artifact` where its int4 weights are in a packing (`recorded`, from
    `packing_record`) that this CPU's kernel does not read."""
    here = CPU_PACKING.layout() if CPU_PACKING is not None else "a layout of its own"
    if recorded is None or recorded == here:
        return
    raise ValueError(
        f"{artifact} holds int4 weights packed for a CPU whose int4 kernel packs {recorded}; "
        f"this CPU's ({torch.backends.cpu.get_cpu_capability()}) packs {here} and would compute "
        "garbage from them: export the model again on a CPU like this one"
    )


def codes_of(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The codes u [rows, in] of a weight in the kernel's packing [out, in // 2] (every row, or
    the rows `rows`), as this machine packs (`cpu_packing`)."""
    return _codes_in(packed, cpu_packing(), rows)


def _codes_in(
    packed: torch.Tensor, packing: CpuPacking, rows: torch.Tensor | None = None
) -> torch.Tensor:
    out, half = packed.shape
    cols = half * 2
    if rows is None:
        rows = torch.arange(out, device=packed.device)
    blocks = packed.view(out // packing.block, cols, packing.block // 2)
    within = rows % packing.block
    if packing.halves:
        byte, high = within % (packing.block // 2), within >= packing.block // 2
    else:
        byte, high = torch.div(within, 2, rounding_mode="floor"), within % 2 == 1
    found = blocks[torch.div(rows, packing.block, rounding_mode="floor"), :, byte]
    shift = high.to(torch.uint8) * 4
    return (found >> shift.unsqueeze(-1)) & 0x0F


def for_cuda(packed: torch.Tensor) -> torch.Tensor:
    """A weight in the CPU kernel's packing [out, in // 2] in CUDA's: int32 tiles
    [out // 8, in // (16 * tiles), 32, tiles // 2], tiles the widest of 8, 4, 2 that divides the
    row (wider tiles: fewer, longer loads; 8 was fastest on an H200). On a CUDA device by CUDA's
    own packing; elsewhere by the same placement of each code (`_tiles_from_rows`)."""
    codes = codes_of(packed)
    if packed.is_cuda:
        plain = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(plain, _cuda_tiles(codes.shape[1]))
    nibbles = _tiles_from_rows(codes)
    raw = nibbles[0::2] | (nibbles[1::2] << 4)
    return raw.view(torch.int32).view(cuda_shape(*codes.shape))


def cuda_shape(rows: int, cols: int) -> tuple[int, int, int, int]:
    """The shape `for_cuda` gives a weight of `rows` by `cols` codes."""
    tiles = _cuda_tiles(cols)
    return rows // 8, cols // (16 * tiles), 32, tiles // 2


def from_cuda(stored: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`for_cuda`'s tiles (any device) back in the CPU kernel's packing, on the CPU."""
    codes = _rows_from_tiles(_nibbles(stored.cpu()), rows, cols)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


# CUDA's packing (`_convert_weight_to_int4pack`, aten/src/ATen/native/cuda/int4mm.cu): lane
# t of a tile of 8 rows and two k-tiles of 16 codes takes the bytes (two codes each, the even
# column in the high nibble) at t % 4 + 0, 4, 8 and 12 of row t // 4, and lays them in one int32,
# their high nibbles in its low 16 bits, their low nibbles in its high 16 bits. So the tiles'
# 4-bit values in memory order, viewed as [row tile r, k-tile t, a, b, pair p, h, c] (lane
# 4a + b, nibble 4h + c of its int32), hold the code of row 8r + a and column
# 32 (t * pairs + p) + 8c + 2b + h: the codes [rows, cols] viewed as [r, a, t, p, c, b, h].
_ROWS_FROM_TILES = (0, 2, 1, 4, 6, 3, 5)
_TILES_FROM_ROWS = (0, 2, 1, 5, 3, 6, 4)


def _rows_from_tiles(nibbles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The codes [rows, cols] of CUDA's tiles given as their 4-bit values in memory order (any
    leading shape that holds them so), in plain ops that Inductor compiles."""
    pairs = _cuda_tiles(cols) // 2
    tiled = nibbles.reshape(rows // 8, cols // (32 * pairs), 8, 4, pairs, 2, 4)
    return tiled.permute(_ROWS_FROM_TILES).reshape(rows, cols)


def _tiles_from_rows(codes: torch.Tensor) -> torch.Tensor:
    """The codes [rows, cols] as CUDA's tiles' 4-bit values in memory order (flat)."""
    rows, cols = codes.shape
    pairs = _cuda_tiles(cols) // 2
    placed = codes.reshape(rows // 8, 8, cols // (32 * pairs), pairs, 4, 4, 2)
    return placed.permute(_TILES_FROM_ROWS).reshape(-1)


def _nibbles(tiles: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of a tensor's bytes in memory order, the low nibble of a byte first."""
    raw = tiles.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(-1)


def _cuda_tiles(cols: int) -> int:
    return next(tiles for tiles in (8, 4, 2) if cols % (16 * tiles) == 0)


def program_for_cuda(program: ExportedProgram) -> ExportedProgram:
    """`program` (its weights on the CUDA device) with every call of the CPU's kernel made one of
    CUDA's; the program itself where it has none. A weight the CPU kernel alone reads is
    repacked in place, under its own name; one that other ops also read in the CPU packing keeps
    it, and the repacked copy is a buffer beside it (`CUDA_SUFFIX`). The program's own graph and
    weights stay as they were."""
    if not any(node.target is _CPU_KERNEL for node in program.graph.nodes):
        return program
    graph_module = copy.deepcopy(program.graph_module)
    calls = [node for node in graph_module.graph.nodes if node.target is _CPU_KERNEL]
    signature = program.graph_signature
    buffer_of = signature.inputs_to_buffers
    state = dict(program.state_dict)
    specs = list(signature.input_specs)
    first_user_input = next(
        node for node in graph_module.graph.nodes if node.name in signature.user_inputs
    )
    repacked: dict[str, torch.fx.Node] = {}
    for call in calls:
        weight = call.args[1]
        name = buffer_of[weight.name]
        if name not in repacked:
            tiles = for_cuda(state[name])
            if len(weight.users) == 1:
                state[name] = tiles
                weight.meta["val"] = _fake_like(weight, tiles)
                repacked[name] = weight
            else:
                repacked[name] = buffer_before(
                    first_user_input, specs, state, name + CUDA_SUFFIX, tiles, weight
                )
        call.target = _CUDA_KERNEL
        call.replace_input_with(weight, repacked[name])
    graph_module.recompile()
    new_signature = type(signature)(input_specs=specs, output_specs=signature.output_specs)
    return program._update(graph_module, new_signature, state_dict=state)


def prompts_through_cublas(program: ExportedProgram) -> ExportedProgram:
    """`program` (rewritten for CUDA) with each call of CUDA's int4 kernel made the weight's
    dequantization (`dequantized_from_tiles`, which Inductor compiles into one kernel) and a
    bfloat16 matmul (cuBLAS): tinygemm computes tiles of 16 rows, and a prompt of 128 or more
    rows takes it 3.4 to 18.5 times as long on an H200 (docs/backends.md). One row is tinygemm's
    best case, so the package's decode step keeps it. The weights stay as they were, the same
    tensors; a program without the kernel is returned as it is."""
    if not any(node.target is _CUDA_KERNEL for node in program.graph.nodes):
        return program
    return program.run_decompositions({_CUDA_KERNEL: _dequantized_matmul})


def _dequantized_matmul(
    x: torch.Tensor, tiles: torch.Tensor, group: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    return x @ dequantized_from_tiles(tiles, group, scales_and_zeros).t()


def dequantized_from_tiles(
    tiles: torch.Tensor, group: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """(u - 8) * s + z [out, in] in bfloat16 of a weight in CUDA's tiles, in plain ops (shifts, a
    permutation: `_rows_from_tiles`)."""
    row_tiles, k_tiles, _, pairs = tiles.shape
    rows, cols = row_tiles * 8, k_tiles * pairs * 32
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=tiles.device)
    nibbles = (tiles.unsqueeze(-1) >> shifts) & 0x0F
    codes = _rows_from_tiles(nibbles, rows, cols).view(rows, cols // group, group)
    scale, zero = (t.t().float().unsqueeze(-1) for t in scales_and_zeros.unbind(-1))
    return ((codes.float() - 8.0) * scale + zero).to(torch.bfloat16).view(rows, cols)


def buffer_before(
    first_user_input: torch.fx.Node,
    specs: list[InputSpec],
    state: dict[str, torch.Tensor],
    name: str,
    value: torch.Tensor,
    like: torch.fx.Node,
) -> torch.fx.Node:
    """A new persistent buffer `name` holding `value`: its placeholder among the buffers'
    (before the user's inputs, which a program's inputs end with), its spec likewise."""
    graph = first_user_input.graph
    with graph.inserting_before(first_user_input):
        node = graph.placeholder(name.replace(".", "_"))
    node.meta["val"] = _fake_like(like, value)
    at = next(i for i, spec in enumerate(specs) if spec.kind is InputKind.USER_INPUT)
    specs.insert(at, InputSpec(InputKind.BUFFER, TensorArgument(node.name), name, True))
    state[name] = value
    return node


def _fake_like(node: torch.fx.Node, value: torch.Tensor) -> torch.Tensor:
    """`value` as a fake tensor of the program's fake mode (the one `node`'s value is of)."""
    return node.meta["val"].fake_mode.from_tensor(value, static_shapes=True)


# Read once, when this module is imported: outside any tracing of a program (codes_of runs
# inside export, where the probe's comparison would not trace).
CPU_PACKING = _packing_read()
