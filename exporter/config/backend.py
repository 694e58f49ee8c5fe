"""The backend and fallback groups' schemas (`backend=`, `fallback=`): what lowers the exported
program, and where the ops it cannot or must not run go."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from omegaconf import MISSING

from exporter.config.model import ModelDtype
from exporter.config.quantize import EmbeddingQuant, QuantScheme
from exporter.errors import ConfigError


class LlmOps(Enum):
    """The ops a causal LM's static KV cache is written and read with, as its backend asks
    (`backend.llm_ops` where the backend has the key): `custom`, ExecuTorch's LLM ops
    (`llama::update_cache` writes each call's keys and values, `llama::custom_sdpa` attends over
    the filled slots); `plain`, transformers' own (index_copy_ writes, its attention over every
    slot with a mask)."""

    custom = "custom"
    plain = "plain"


@dataclass
class BackendConfig:
    """What every backend has; each backend module subclasses it with its own defaults and
    settings (exporter/backends/). `atol`/`rtol` are the backend's default tolerances, which
    `validate.atol/rtol` override; `device` is where the artifact runs, one of the backend's
    `devices` (every backend has the key, so a sweep over backends can set it once)."""

    # The devices this backend's artifact runs on: PyTorch's (cpu, cuda), or a wgpu adapter
    # choice for backend=webgpu (auto, gpu, cpu).
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    # The model dtypes (`model.dtype`) its artifacts compute in.
    dtypes: ClassVar[tuple[ModelDtype, ...]] = tuple(ModelDtype)
    # The quantization schemes (`quantize=`) and embedding quantizations (`quantize.embedding`)
    # its artifacts compute right: float only unless the backend says, since a lowering can
    # take a quantized pattern without an error and compute garbage (docs/quantization.md).
    quant_schemes: ClassVar[tuple[QuantScheme, ...]] = (QuantScheme.none,)
    embedding_quants: ClassVar[tuple[EmbeddingQuant, ...]] = (EmbeddingQuant.none,)
    # Why it runs no other: what the refusal of another quotes.
    quant_refusal: ClassVar[str] = ""
    # quantize=int4_weight computed by PyTorch's int4 kernel (exporter/quantize/packed.py: codes
    # read as 4 bits), not by torchao's layer (codes a byte each, dequantized before a matmul).
    int4_weight_packed: ClassVar[bool] = False
    # Why it does not lower a program whose unproven guards are asserts checked at run time
    # (export.guards=runtime); empty where it does.
    runtime_guards_refusal: ClassVar[str] = "no job has lowered such a program with it yet"
    # Why it does not lower a model with an encode method beside its decoder (Whisper's
    # encoder, which fills the decoder's cross-attention cache once a clip); empty where it does.
    encode_method_refusal: ClassVar[str] = "its lowering carries one method, not a second yet"

    name: str = MISSING
    atol: float = MISSING
    rtol: float = MISSING
    device: str = "cpu"

    def quantize_recipes(self) -> tuple[str, ...]:
        """What `quantize=auto` chooses from per layer on this backend, smallest first
        (exporter/quantize/recipes.py names them); none: it plans nothing here."""
        return ()

    def __post_init__(self) -> None:
        if self.device not in self.devices:
            allowed = " or ".join(filter(None, [", ".join(self.devices[:-1]), self.devices[-1]]))
            raise ConfigError(
                f"backend.device={self.device}: backend={self.name} runs on {allowed} "
                "(allowed values of backend.device)."
            )


class FallbackPolicy(Enum):
    auto = "auto"
    strict = "strict"
    data_dependent = "data_dependent"


class WrongKernels(Enum):
    """Ops a backend's delegate is known to compute as another function than the op asks
    (exporter/backends/common/xnnpack_rewrites.py): `avoid` rewrites each into ops the delegate
    computes right, `allow` lets the delegate take them as its partitioner would."""

    avoid = "avoid"
    allow = "allow"


@dataclass
class FallbackConfig:
    """Where ops the backend cannot or must not run go: one vocabulary that each backend maps to
    its own controls.

    `auto`: the backend takes what it can, the rest runs on the portable CPU kernels (or in
    PyTorch); `strict`: everything on the backend, or the job fails at lowering;
    `data_dependent`: like auto, and every node whose output shape depends on tensor values
    (nonzero, boolean indexing, masked_select, unique...) stays off the backend.
    `ops` forces the named ATen ops ("aten.nonzero.default") off the backend; `min_block_size`
    is the fewest compute nodes a delegated block may have; `wrong_kernels` what becomes of ops
    the backend is known to compute wrongly."""

    policy: FallbackPolicy = MISSING
    ops: list[str] = field(default_factory=list)
    min_block_size: int = 1
    wrong_kernels: WrongKernels = WrongKernels.avoid

    def __post_init__(self) -> None:
        if self.min_block_size < 1:
            raise ConfigError(
                f"fallback.min_block_size is {self.min_block_size}; it must be 1 or more."
            )
        for op in self.ops:
            if op.count(".") != 2 or not all(op.split(".")):
                raise not_an_op(op)
        if self.policy is FallbackPolicy.strict and self.ops:
            raise ConfigError(
                f"fallback=strict requires every op on the backend, but fallback.ops forces "
                f"{', '.join(self.ops)} off it; use fallback=auto with fallback.ops, or drop "
                "fallback.ops."
            )
        if self.policy is FallbackPolicy.strict and self.min_block_size > 1:
            raise ConfigError(
                f"fallback=strict requires every op on the backend, but "
                f"fallback.min_block_size={self.min_block_size} keeps smaller blocks off it; "
                "use fallback=auto with fallback.min_block_size, or set it to 1."
            )

    def partitioning(self) -> dict[str, Any]:
        """What changes the partition; `strict` and `auto` partition alike and differ in the
        verdict only, so a strict job can reuse an auto job's lowering."""
        return {
            "data_dependent_off": self.policy is FallbackPolicy.data_dependent,
            "ops": sorted(self.ops),
            "min_block_size": self.min_block_size,
            "wrong_kernels": self.wrong_kernels.value,
        }


def not_an_op(op: str) -> ConfigError:
    """The refusal of a `fallback.ops` entry that names no operator overload as the partition
    report prints it, namespace.name.overload: of its form here, of an ATen name torch does not
    declare in exporter/config/inputs.py."""
    return ConfigError(
        f"fallback.ops has {op!r}, which is not an operator overload; write it as the "
        "partition report prints ops, namespace.name.overload (aten.nonzero.default)."
    )
