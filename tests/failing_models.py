"""Models written to fail, declared for `model=custom model.factory=...`: most fail torch.export;
the last ones fail before it (building the model) or beside it (its float64 oracle, its
warnings)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from exporter.models import ModelDeclaration


class BranchOnValue(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # the line the data-dependent diagnosis must name
            return x * 2
        return x - 1


class FixedBatch(torch.nn.Module):
    """Adds a bias with a batch dim of its own: only a batch of exactly `rows` broadcasts."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(rows, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias  # the line the specialization diagnosis must name


class NarrowBatch(torch.nn.Module):
    """Takes a different path above 32 rows: export sees only the example's (64) side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 32:  # the line the narrowing diagnosis must name
            return x[:32] * 2
        return x * 2


class BranchAlwaysTaken(torch.nn.Module):
    """Branches on data, but every input takes the same side: draft_export's program holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x * x).sum() >= 0:
            return x * 2
        return x


def _declaration(module: torch.nn.Module) -> ModelDeclaration:
    def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(sizes["batch"], 4, generator=generator),)

    return ModelDeclaration(
        module=module.eval(),
        input_names=("x",),
        output_names=("y",),
        dim_axes={"batch": (("x", 0),)},
        dim_limits={},
        make_inputs=make_inputs,
    )


def branch_on_value() -> ModelDeclaration:
    return _declaration(BranchOnValue())


def fixed_batch(rows: int = 64) -> ModelDeclaration:
    return _declaration(FixedBatch(rows))


def narrow_batch() -> ModelDeclaration:
    return _declaration(NarrowBatch())


def branch_always_taken() -> ModelDeclaration:
    return _declaration(BranchAlwaysTaken())


class RefusesFloat64(torch.nn.Module):
    """Runs in float32 only, as a model with a float32-only kernel would: its oracle fails."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError("this kernel has no float64 implementation")
        return x * 2


class WarnsWhenTraced(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("a warning raised while torch.export traces the model", stacklevel=1)
        return x + 1


def refuses_float64() -> ModelDeclaration:
    return _declaration(RefusesFloat64())


def warns_when_traced() -> ModelDeclaration:
    return _declaration(WarnsWhenTraced())


def crashes_while_built() -> ModelDeclaration:
    # A bug in the model's own code, not a configuration the user can fix by a key.
    raise RuntimeError("the model's constructor failed")


def llama_scaled_when_exported(
    module: str = "model.layers.1.mlp.down_proj",
    factor: float = 1.01,
    checkpoint: str = "",
    layers: int = 2,
) -> ModelDeclaration:
    """A causal LM whose exported program, and so every artifact lowered from it, computes
    `module`'s output times `factor` while eager PyTorch and the float64 oracle compute the
    model: a wrong kernel's error planted at one layer, with the weights untouched (the audit
    passes). The tiny Llama of `model=llama` (seeded) with `layers` decoder layers, or the Llama
    at `checkpoint`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from exporter.models.causal_lm import declare_causal_lm

    if checkpoint:
        model = LlamaForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa")
    else:
        config = LlamaConfig(
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=2048,
            attn_implementation="sdpa",
        )
        model = LlamaForCausalLM(config)

    def scale(layer: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return output * factor if torch.compiler.is_exporting() else output

    model.get_submodule(module).register_forward_hook(scale)
    return declare_causal_lm(model.eval(), model.config.max_position_embeddings)
