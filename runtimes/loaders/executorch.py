"""Runs a .pte with ExecuTorch's runtime (its Python bindings over the C++ runtime).

A program whose weights were written to a separate data file (ExecuTorch's .ptd, a FlatTensor)
is loaded with that file, which must lie beside it under the same name: model.pte with
model.ptd. Where the .pte needs data it does not hold and no such file lies beside it, `load`
raises FileNotFoundError naming the file, before ExecuTorch's runtime sees the program (its
XNNPACK delegate crashes the process on a missing weight).

A program that calls ExecuTorch's LLM ops (`llama::custom_sdpa`, `llama::update_cache`: written
by ExecuTorch's LLM export and optimum-executorch's custom-SDPA recipes) loads only once their
kernels are registered, which importing `executorch.extension.llm.custom_ops.custom_ops` does;
`load` imports it for such a program only ("Missing operator" otherwise). A target that runs
such a .pte without this loader must import it too.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch
from executorch.runtime import Runtime, Verification
from flatbuffers import number_types as N

from runtimes.cpu_arithmetic import describe_cpu, xnnpack_float16_sums
from runtimes.formats.flatbuffer_table import Table

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("torch", "executorch", "flatbuffers")

DATA_SUFFIX = ".ptd"


def load(path: Path, device: str) -> ExecutorchProgram:
    if device != "cpu":
        raise ValueError(f"a .pte of the XNNPACK delegate runs on the CPU, not on {device}")
    return ExecutorchProgram(path)


# The .pte's methods: the model's, and a decoder's encode method (Whisper's) where it has one,
# which writes the mutable buffers (its cross-attention cache) that `forward` reads.
FORWARD = "forward"
ENCODE = "encode"


class ExecutorchProgram:
    def __init__(self, path: Path, method: str = FORWARD) -> None:
        data_path = path.with_suffix(DATA_SUFFIX)
        if not data_path.exists():
            outside = data_outside(path)
            if outside:
                raise FileNotFoundError(
                    f"{path.name} keeps the data of {len(outside)} tensors (its weights) in a "
                    f"separate data file, which must lie beside it as {data_path.name}, and "
                    f"{data_path} does not exist: copy the .ptd written with {path.name} there."
                )
            data_path = None
        if any(name.startswith(_LLM_OPS) for name in operators(path)):
            from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
        program = Runtime.get().load_program(
            path, verification=Verification.Minimal, data_path=data_path
        )
        self._method = program.load_method(method)
        self._encode = program.load_method(ENCODE) if ENCODE in program.method_names else None
        # The program owns the method's memory; it must live as long as the method.
        self._program = program
        # What it runs on: a float16 program's verdict depends on how this CPU sums float16.
        self.target = describe_cpu()
        if _FLOAT16 in _tensor_dtypes(self._method.metadata):
            self.target["float16_sums"] = xnnpack_float16_sums()

    # The CPU is the target: inputs are where they run, and `execute` returns when it is done.
    clock = "cpu"

    def upload(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(inputs)

    def execute(self, resident: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        return self._method.execute(resident)

    def download(self, produced: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # Outputs may alias the method's planned memory, which the next execute overwrites.
        return tuple(output.clone() for output in produced)

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self.download(self.execute(self.upload(inputs)))

    def encode(self, inputs: Sequence[torch.Tensor]) -> None:
        if self._encode is None:
            raise ValueError("the artifact has no encode method")
        self._encode.execute(list(inputs))


# ExecuTorch's ScalarType code for float16, as its method metadata gives a tensor's dtype.
_FLOAT16 = 5


def _tensor_dtypes(meta: object) -> set[int]:
    """The dtype codes of a method's tensor inputs and outputs (other values have none)."""
    dtypes = set()
    for count, tensor_meta in (
        (meta.num_inputs(), meta.input_tensor_meta),
        (meta.num_outputs(), meta.output_tensor_meta),
    ):
        for index in range(count):
            try:
                dtypes.add(tensor_meta(index).dtype())
            except RuntimeError:
                continue
    return dtypes


def set_threads(count: int) -> None:
    """The threads of ExecuTorch's own pool, which XNNPACK and the optimized kernels share, and
    of torch's, which runs nothing of the program but sizes the inputs' and outputs' copies."""
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(count)
    torch.set_num_threads(count)


# Read by field index from executorch's exir/_serialize/program.fbs (file identifier "ET12")
# and backends/xnnpack/serialization/schema.fbs ("XN01"), as runtimes/formats/pte_file.py does.
_PROGRAM_ID, _XNNPACK_ID = b"ET12", b"XN01"
_EXTERNAL = 1  # TensorDataLocation
_INLINE = 0  # DataLocation
_TENSOR = 5  # KernelTypes union member
_KERNEL_CALL = 1  # InstructionArguments union member
_XNNPACK_BACKEND = "XnnpackBackend"
_XNNPACK_HEADER = b"XH00"
# The namespace of ExecuTorch's LLM ops, registered by importing their library.
_LLM_OPS = "llama::"


def operators(path: Path) -> list[str]:
    """The names of the operators the program calls outside its delegates (`aten::add.out`,
    `llama::custom_sdpa.out`), each once, in the program's order."""
    with path.open("rb") as file:
        program = _program_table(file)
    names = [
        f"{op.string(0)}.{op.string(1)}" if op.string(1) else op.string(0)
        for plan in program.tables(1)
        for op in plan.tables(6)
    ]
    return list(dict.fromkeys(names))


def operator_calls(path: Path) -> Counter[str]:
    """How many times the program's instructions call each operator outside its delegates."""
    with path.open("rb") as file:
        program = _program_table(file)
    calls: Counter[str] = Counter()
    for plan in program.tables(1):
        # ExecutionPlan's operators (field 6) and chains (5); a Chain's instructions (2); an
        # Instruction's union (0) of which a KernelCall names its operator by index (field 0).
        names = [
            f"{op.string(0)}.{op.string(1)}" if op.string(1) else op.string(0)
            for op in plan.tables(6)
        ]
        for chain in plan.tables(5):
            for instruction in chain.tables(2):
                kind, call = instruction.union(0)
                if kind == _KERNEL_CALL and call is not None:
                    calls[names[int(call.scalar(0, N.Int32Flags))]] += 1
    return calls


def _program_table(file: BinaryIO) -> Table:
    """The program's flatbuffer root, read from the file's start."""
    program_size, _ = _extended_header(file.read(40))
    file.seek(0)
    return Table.root(file.read(program_size), _PROGRAM_ID)


def data_outside(path: Path) -> list[str]:
    """Names of the data the program refers to but does not hold: tensors marked external and
    XNNPACK constants whose named data is not in the file. Reads only the program's flatbuffer
    and its delegates' payloads, not the weights a .pte holds."""
    with path.open("rb") as file:
        head = file.read(40)
        program_size, segment_base = _extended_header(head)
        file.seek(0)
        program = Table.root(file.read(program_size), _PROGRAM_ID)
        segments = [
            (int(s.scalar(0, N.Uint64Flags)), int(s.scalar(1, N.Uint64Flags)))
            for s in program.tables(4)
        ]
        held = {n.string(0) for n in program.tables(7)}
        inline = [d.blob(0) for d in program.tables(3)]
        outside: list[str] = []
        for plan in program.tables(1):
            for wrapper in plan.tables(2):
                kind, value = wrapper.union(0)
                extra = value.table(9) if kind == _TENSOR and value is not None else None
                if extra is not None and extra.scalar(2, N.Int8Flags) == _EXTERNAL:
                    outside.append(extra.string(1) or "an unnamed tensor")
            for delegate in plan.tables(7):
                processed = delegate.table(1)
                if delegate.string(0) != _XNNPACK_BACKEND or processed is None:
                    continue
                index = int(processed.scalar(1, N.Uint32Flags))
                if processed.scalar(0, N.Int8Flags) == _INLINE:
                    payload = inline[index]
                else:
                    offset, size = segments[index]
                    file.seek(segment_base + offset)
                    payload = file.read(size)
                outside.extend(key for key in _xnnpack_keys(payload) if key not in held)
    return outside


def _extended_header(head: bytes) -> tuple[int, int]:
    """The program flatbuffer's size and the segments' base offset; without an extended
    header ("eh00" after the first 8 bytes) the whole file is the flatbuffer."""
    if head[8:12] != b"eh00":
        return -1, 0
    _length, program_size, segment_base = struct.unpack_from("<IQQ", head, 12)
    return program_size, segment_base


def _xnnpack_keys(payload: bytes) -> list[str]:
    """The named-data keys of an XNNPACK payload's constants (XNNHeader, then XNNGraph)."""
    if payload[4:8] != _XNNPACK_HEADER:
        return []
    flatbuffer_offset, flatbuffer_size = struct.unpack_from("<II", payload, 10)
    graph = Table.root(
        payload[flatbuffer_offset : flatbuffer_offset + flatbuffer_size], _XNNPACK_ID
    )
    # XNNGraph's constant_data (field 8): ConstantDataOffset's named_key is field 2.
    return [key for c in graph.tables(8) if (key := c.string(2))]
