"""AOTInductor: torch._inductor compiles the exported program, its dynamic dims kept, into a .pt2
package of native code (C++ on the CPU, Triton kernels on CUDA) that `aoti_load_package` runs.

Inductor compiles every op of the program, data-dependent ones included (nonzero's count becomes
a runtime size), so nothing is partitioned and nothing falls back.

A program with a KV cache whose smallest call is one token is compiled twice into one package on
CUDA (`backend.decode_step`): as exported, and for that call, its seq dim static, as the package's
`decode_step` model, which runs every decode step. Its matmuls of one row are then Inductor's own
reductions, fused with the norms and activations around them, where a symbolic row count leaves them
to cuBLAS: on an H200, a 4-layer Llama-3.2-1B-shaped decode step went from 72 kernels to 47 and from
0.520 to 0.436 ms (docs/backends.md). Both models read the same weights and cache: the package keeps
one copy, and the loader hands the same tensors to both. With int4 weights, the decode step computes
its matmuls of one row with CUDA's int4 kernel, and the program its prompts' with cuBLAS, each
weight dequantized first: the int4 kernel takes 3.4 to 18.5 times as long over 128 rows or more.
On CUDA the int4 projections of one input are one call of the kernel (`backend.fused_projections`):
a full-size int4 decode step 1.11x faster. And the decode step's attention, its cache write and
RoPE are one Triton kernel of the project's (`backend.decode_attention`): 1.02x to 1.07x faster
at full size in bfloat16.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from exporter.artifact import Artifact, Output, WeightsReader, fused_weights
from exporter.artifact.fused_weights import FUSED_WEIGHTS, Fused
from exporter.backends.common.declaration import Backend
from exporter.config import BackendConfig, EmbeddingQuant, FallbackConfig, QuantScheme
from exporter.errors import ConfigError
from exporter.files import atomic_path
from exporter.process import progress

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

    from exporter.export import Exported

log = logging.getLogger(__name__)


@dataclass
class AotiConfig(BackendConfig):
    """`device=cuda` compiles Triton kernels for the GPU this machine has."""

    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    runtime_guards_refusal: ClassVar[str] = ""
    encode_method_refusal: ClassVar[str] = ""
    # torchao's quantized layers run as PyTorch computes them (Inductor compiles the
    # dequantization into its kernels); int4_weight and quantize=auto's layers through
    # PyTorch's int4 kernel.
    quant_schemes: ClassVar[tuple[QuantScheme, ...]] = tuple(QuantScheme)
    embedding_quants: ClassVar[tuple[EmbeddingQuant, ...]] = tuple(EmbeddingQuant)
    int4_weight_packed: ClassVar[bool] = True

    name: str = "aoti"
    atol: float = 1.0e-4
    rtol: float = 1.0e-3
    device: str = "cpu"
    # The one-token call of a program with a KV cache compiled apart (the module docstring):
    # null where it was measured to pay (on CUDA); true or false
    # wherever the program has a KV cache and one-token calls.
    decode_step: bool | None = None
    # int4 projections of one input computed by one call of the int4 kernel
    # (exporter/backends/common/fused_projections.py): null where it was measured to pay (on
    # CUDA); true or false on any device. Layers without int4 weights are left as they are.
    fused_projections: bool | None = None
    # The decode step's attention computed by the project's Triton kernel, the cache write and
    # RoPE in it (exporter/backends/common/decode_attention.py): null where it was measured to
    # pay (on CUDA); true or false on CUDA.
    decode_attention: bool | None = None

    def quantize_recipes(self) -> tuple[str, ...]:
        # PyTorch's packed int4 kernel (which holds a GGUF file's 4-bit and 8-bit codes): the
        # CPU's, repacked for CUDA's on CUDA (runtimes/int4_kernels.py).
        return ("int4_g128", "int4", "int8", "float")


class Aoti(Backend):
    def check(self, config: AotiConfig, fallback: FallbackConfig) -> None:
        from exporter.backends.common import torch_device

        torch_device.require(config.device)
        _compiler()
        if config.decode_attention and config.device == "cpu":
            raise ConfigError(
                "backend.decode_attention=true: its kernel is compiled for CUDA, and "
                "backend.device=cpu; set it to null or false, or backend.device=cuda"
            )

    def output(self, config: AotiConfig) -> Output:
        return Output(
            file="model.pt2", runtime=self.runtime, audit=self.audit, device=config.device
        )

    def toolchain(self, config: AotiConfig) -> dict[str, str]:
        from exporter.backends.common import torch_device

        compiler = _compiler()
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        return {
            "device": torch_device.describe(config.device),
            "compiler": version[0] if version else "",
            # Where the package keeps the weights: it changes the artifact, so it is in the key.
            "weights": ",".join(f"{k}={v}" for k, v in sorted(_inductor_configs().items())),
        }

    def lower(
        self, exported: Exported, config: AotiConfig, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        from exporter.backends.common import torch_device

        if fallback.ops or fallback.min_block_size > 1:
            log.warning(
                "[lower] backend=aoti compiles every op into the package; fallback.ops and "
                "fallback.min_block_size do not apply to it"
            )
        log.info("[lower] AOTInductor: compiling for %s", torch_device.describe(config.device))
        progress.doing("AOTInductor compiles the program and packages it")
        target = self.output(config)
        path = out_dir / target.file
        with atomic_path(path) as temporary:
            compile_package(
                exported.program,
                one_token_call(exported),
                config,
                temporary,
                encode=exported.encode,
            )
        return Artifact.at(path, target, partition=None)


BACKEND = Aoti(schema=AotiConfig, runtime="aoti", delegate=None, audit=WeightsReader.aoti_package)

# What the decode step is compiled with beyond _inductor_configs: with coordinate-descent
# tuning, Inductor computes a matmul of one row as a reduction of its own (mul, sum: mm's
# decomposition in torch/_inductor/decomposition.py), into which it fuses the ops around it,
# and tunes each kernel's block sizes.
DECODE_STEP_OPTIONS: Mapping[str, object] = {"coordinate_descent_tuning": True}


def compile_package(
    program: ExportedProgram,
    one_token: tuple[torch.Tensor, ...] | None,
    config: AotiConfig,
    path: Path,
    options: Mapping[str, object] | None = None,
    encode: ExportedProgram | None = None,
) -> None:
    """`program` (on the CPU) compiled for `config.device` into the package at `path`, with
    `options` beyond the backend's own: moved to the device (CUDA's int4 kernel for the CPU's),
    and with its decode step where `compiles_decode_step` says and the program has a one-token
    call (`one_token`, one_token_call's inputs); with its decoder's `encode` method, where it
    has one, as a model of the package that shares the program's state. A package with a decode
    step computes its prompts' int4 matmuls by cuBLAS, its decode steps' by CUDA's int4 kernel
    (`int4_kernels.prompts_through_cublas`), and its attentions by the project's kernel where
    `computes_decode_attention` says. The int4 projections of one input are one call where
    `fuses_projections` says, the weights that encode reads left apart."""
    from torch.export.passes import move_to_device_pass

    from exporter.backends.common import torch_device
    from exporter.backends.common.fused_projections import fused_projections
    from runtimes import int4_kernels

    fused: dict[str, Fused] = {}
    if fuses_projections(config):
        keep = () if encode is None else tuple(encode.state_dict)
        program, fused = fused_projections(program, keep)
        if fused:
            log.info(
                "[lower] AOTInductor: int4 projections of one input fused into %d calls",
                len(fused) // 2,
            )
    device = torch_device.indexed(config.device)
    if config.device != "cpu":
        program = int4_kernels.program_for_cuda(move_to_device_pass(program, device))
        encode = None if encode is None else move_to_device_pass(encode, device)
    if encode is not None:
        encode = sharing_state(encode, program)
    decode_step = None
    if compiles_decode_step(config):
        if one_token is None:
            if config.decode_step:
                log.warning(
                    "[lower] backend.decode_step=true: the program has no KV cache whose "
                    "smallest call is one token, so there is no decode step to compile apart"
                )
        else:
            log.info(
                "[lower] AOTInductor: the one-token call (%s) compiled apart too, as the "
                "package's decode step",
                ", ".join(str(list(x.shape)) for x in one_token),
            )
            on_device = tuple(x.to(device) for x in one_token)
            decode_step = decode_step_program(program, on_device)
            if computes_decode_attention(config):
                from exporter.backends.common import decode_attention

                log.info(
                    "[lower] AOTInductor: %d attentions of the decode step through the "
                    "project's kernel",
                    decode_attention.rewritten(decode_step),
                )
            program = int4_kernels.prompts_through_cublas(program)
    metadata = {FUSED_WEIGHTS: fused_weights.to_json(fused)} if fused else {}
    metadata |= int4_kernels.packing_record(program)
    package(program, path, decode_step, options, encode, metadata)


def sharing_state(encode: ExportedProgram, program: ExportedProgram) -> ExportedProgram:
    """`encode` with each weight and buffer that `program` has under the same name made
    `program`'s tensor: the package then stores it once, and the loader hands both models the
    same tensor, so what encode writes (a decoder's cross-attention cache) the program reads."""
    for own, theirs in (
        (encode.state_dict, program.state_dict),
        (encode.constants, program.constants),
    ):
        for name in own:
            if name in theirs:
                own[name] = theirs[name]
    return encode


def decode_step_program(
    program: ExportedProgram, one_token: tuple[torch.Tensor, ...]
) -> ExportedProgram:
    """`program` re-exported for the call of `one_token`, its shapes static; its weights and
    KV cache are `program`'s own tensors."""
    import torch

    return torch.export.export(program.module(), one_token, strict=False)


def package(
    program: ExportedProgram,
    path: Path,
    decode_step: ExportedProgram | None = None,
    options: Mapping[str, object] | None = None,
    encode: ExportedProgram | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """`program` compiled into the package at `path` (its name ends in .pt2), with `options`
    beyond the backend's own; `decode_step` compiled beside it, its call's shapes in its
    metadata; `encode` too; `metadata` in every model's. Weights they share (the same tensors)
    are packaged once."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    from runtimes.loaders.aoti import CALL_SHAPES, DECODE_STEP, ENCODE, MODEL

    models = {MODEL: program, DECODE_STEP: decode_step, ENCODE: encode}
    models = {name: model for name, model in models.items() if model is not None}
    compiled = {}
    for name, model in models.items():
        args, kwargs = model.example_inputs
        settings = {**_inductor_configs(), **(options or {}), "aot_inductor.package": True}
        own_metadata = dict(metadata or {})
        if name == DECODE_STEP:
            own_metadata[CALL_SHAPES] = json.dumps([list(x.shape) for x in args])
            settings = {**settings, **DECODE_STEP_OPTIONS}
        settings["aot_inductor.metadata"] = own_metadata
        # What aoti_compile_and_package does with one program.
        compiled[name] = aot_compile(
            model.module(check_guards=False), args, kwargs, options=settings
        )
    package_aoti(str(path), compiled)


def compiles_decode_step(config: AotiConfig) -> bool:
    """`backend.decode_step`, or where it is null, where the decode step was measured to pay: on
    CUDA. On an H200, a 4-layer Llama-3.2-1B-shaped package's decode step took 0.436 ms with it
    against 0.520 in bfloat16. With int4_weight it decodes in the time the package without it
    does (1.197 against 1.199 ms at full size), and it lets the package's prompts run on cuBLAS
    (docs/backends.md). On the CPU it changed nothing (1.00x, llama_45m)."""
    if config.decode_step is not None:
        return config.decode_step
    return config.device != "cpu"


def fuses_projections(config: AotiConfig) -> bool:
    """`backend.fused_projections`, or where it is null, where it was measured to pay: on CUDA,
    where a Llama-3.2-1B-shaped int4 decode step took 1.084 ms a token with it against 1.204 on
    an H200 (exporter/backends/common/fused_projections.py). Not measured on the CPU."""
    if config.fused_projections is not None:
        return config.fused_projections
    return config.device != "cpu"


def computes_decode_attention(config: AotiConfig) -> bool:
    """`backend.decode_attention`, or where it is null, where the kernel was measured to pay: on
    CUDA (docs/backends.md)."""
    if config.decode_attention is not None:
        return config.decode_attention
    return config.device != "cpu"


def one_token_call(exported: Exported) -> tuple[torch.Tensor, ...] | None:
    """The inputs of the program's smallest call where that call is one decode step: the
    program has a KV cache, and its smallest call is one token (each dynamic dim at 1)."""
    import torch

    metadata = exported.runner_metadata
    if not metadata.get("use_kv_cache") or not metadata.get("enable_dynamic_shape"):
        return None
    if any(profile.min_shape[axis] != 1 for profile in exported.inputs for axis in profile.dims):
        return None
    return tuple(torch.zeros(p.min_shape, dtype=p.dtype) for p in exported.inputs)


def _inductor_configs() -> dict[str, object]:
    """The weights go into the package as one pickled tensor per weight (data/weights/), not
    into the .so. By default Inductor copies every weight into one bytearray to build the .so's
    data section, and patches it into the object file with a slice of that bytearray (another
    copy): the lowering peaked at about three times the weights. And the loader, on the CPU,
    copies the data section (which the .so's mapping keeps resident) into a buffer of its own:
    two times at validation. Pickled weights are written one at a time from the program's own
    tensors, and loaded once, used in place (runtimes/loaders/aoti.py). Both options are
    experimental in torch; where this torch lacks them, the defaults stand."""
    from torch._inductor import config

    options: dict[str, object] = {}
    if hasattr(config.aot_inductor, "package_constants_in_so") and hasattr(
        config.aot_inductor, "package_constants_on_disk_format"
    ):
        options = {
            "aot_inductor.package_constants_in_so": False,
            "aot_inductor.package_constants_on_disk_format": "pickle_weights",
        }
    return options


def _compiler() -> str:
    """The C++ compiler Inductor will build the package with (it looks for g++, or $CXX)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except Exception as error:
        raise ConfigError(
            f"backend=aoti builds the package with a C++ compiler, and none was found ({error}); "
            "install one (Debian: apt-get install g++) or name it in the CXX environment variable."
        ) from error
