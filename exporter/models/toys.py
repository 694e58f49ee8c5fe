"""Toy models: each isolates one op pattern of a transformer (an RMSNorm, a linear layer, grouped-
query attention, an embedding lookup, rotary embeddings), small enough to read in its lowered
graph. They prove a backend's kernels, its fusions and its resize rules at every live shape of
one dynamic dim before a whole model mixes them up.

`model=<kind>` picks one (conf/model/<kind>.yaml); `dynamic=<kind>` bounds its dim: `m` for
linear's rows, `seq` for the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from exporter.config import ToyConfig, ToyKind
from exporter.errors import ConfigError
from exporter.models.bundle import ModelDeclaration


class RmsNorm(torch.nn.Module):
    """Written as transformers' LlamaRMSNorm is: that node pattern is what ExecuTorch's
    Vulkan/WebGPU lowering matches and fuses into et_vk.rms_norm."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        # Not all ones: a kernel that drops or misplaces the weight must change the output.
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RmsNormChain(torch.nn.Module):
    """One norm feeding another: the second's input is the first's (possibly fused) output."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.first = RmsNorm(hidden, eps)
        self.second = RmsNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class RmsNormResidual(torch.nn.Module):
    """The norm's input read again after it, as a residual connection does."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RmsNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + x


class RmsNormGated(torch.nn.Module):
    """The norm's output multiplied once more: a mul right after the mul a fusion anchors on."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RmsNorm(hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * x


class GqaAttention(torch.nn.Module):
    """Causal attention with fewer key/value heads than query heads: query head h reads key/value
    head h // (heads // kv_heads), as enable_gqa defines it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Rotary(torch.nn.Module):
    """Llama's rotary position embedding of q and k, its cos/sin tables built for max_positions
    and sliced to the live seq."""

    def __init__(self, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = q.shape[2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def declare(cfg: ToyConfig) -> ModelDeclaration:
    return _TOYS[cfg.kind](cfg)


# The live size of the toy's dim -> one input's shape.
Shape = Callable[[int], tuple[int, ...]]


def _float_toy(
    module: torch.nn.Module,
    dim: str,
    axis: int,
    shapes: Mapping[str, Shape],
    output_names: tuple[str, ...] = ("y",),
    limit: int | None = None,
) -> ModelDeclaration:
    """A toy whose inputs are all float32 normals, `dim` at `axis` of each."""

    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return tuple(
            torch.randn(shape(sizes[dim]), generator=generator) for shape in shapes.values()
        )

    return ModelDeclaration(
        module=module.eval(),
        input_names=tuple(shapes),
        output_names=output_names,
        dim_axes={dim: tuple((name, axis) for name in shapes)},
        dim_limits={} if limit is None else {dim: limit},
        make_inputs=make_inputs,
    )


def _norm_toy(norm: type[torch.nn.Module]) -> Callable[[ToyConfig], ModelDeclaration]:
    def declare_norm(cfg: ToyConfig) -> ModelDeclaration:
        return _float_toy(
            norm(cfg.hidden, cfg.eps), "seq", 1, {"x": lambda seq: (1, seq, cfg.hidden)}
        )

    return declare_norm


def _linear(cfg: ToyConfig) -> ModelDeclaration:
    module = torch.nn.Linear(cfg.hidden, cfg.out_features, bias=True)
    return _float_toy(module, "m", 0, {"x": lambda m: (m, cfg.hidden)})


def _gqa_attention(cfg: ToyConfig) -> ModelDeclaration:
    if cfg.heads % cfg.kv_heads:
        raise ConfigError(
            f"model.heads ({cfg.heads}) is not a multiple of model.kv_heads ({cfg.kv_heads}); "
            "each key/value head serves the same number of query heads."
        )
    shapes = {
        "q": lambda seq: (1, cfg.heads, seq, cfg.head_dim),
        "k": lambda seq: (1, cfg.kv_heads, seq, cfg.head_dim),
        "v": lambda seq: (1, cfg.kv_heads, seq, cfg.head_dim),
    }
    return _float_toy(GqaAttention(), "seq", 2, shapes)


def _rotary(cfg: ToyConfig) -> ModelDeclaration:
    if cfg.head_dim % 2:
        raise ConfigError(
            f"model.head_dim is {cfg.head_dim}; rotary embeddings rotate pairs of features, "
            "so it must be even."
        )
    shapes = {
        "q": lambda seq: (1, cfg.heads, seq, cfg.head_dim),
        "k": lambda seq: (1, cfg.kv_heads, seq, cfg.head_dim),
    }
    module = Rotary(cfg.head_dim, cfg.max_positions)
    return _float_toy(module, "seq", 2, shapes, ("q_rot", "k_rot"), limit=cfg.max_positions)


def _embedding(cfg: ToyConfig) -> ModelDeclaration:
    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randint(0, cfg.vocab, (1, sizes["seq"]), generator=generator),)

    return ModelDeclaration(
        module=torch.nn.Embedding(cfg.vocab, cfg.hidden).eval(),
        input_names=("ids",),
        output_names=("y",),
        dim_axes={"seq": (("ids", 1),)},
        dim_limits={},
        make_inputs=make_inputs,
    )


_TOYS: dict[ToyKind, Callable[[ToyConfig], ModelDeclaration]] = {
    ToyKind.rms_norm: _norm_toy(RmsNorm),
    ToyKind.rms_norm_chain: _norm_toy(RmsNormChain),
    ToyKind.rms_norm_residual: _norm_toy(RmsNormResidual),
    ToyKind.rms_norm_gated: _norm_toy(RmsNormGated),
    ToyKind.linear: _linear,
    ToyKind.gqa_attention: _gqa_attention,
    ToyKind.embedding: _embedding,
    ToyKind.rotary: _rotary,
}
