"""A transformers static cache written and read by ExecuTorch's LLM ops: `llama::update_cache`
writes a call's keys and values into the cache, `llama::custom_sdpa` attends over the cache's
filled slots (causal, from the call's first position), as ExecuTorch's own Llama export and
optimum-executorch's custom-SDPA recipe do. Both ops keep the cache as [batch, slots, heads,
head_dim] (slots second, where transformers' StaticLayer keeps heads second).

The ops are registered by importing ExecuTorch's custom-ops library (its CPU kernels run them in
eager PyTorch too); a .pte that calls them loads once a target has imported it
(runtimes/loaders/executorch.py does).

The model's attention implementation names the ops' attention only for the length of the cache
module's call (causal_lm.LlmOpsCacheLM), so the same model without a cache (the float64 oracle's)
keeps transformers' own attention.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import StaticLayer
from transformers.masking_utils import AttentionMaskInterface

# The attention implementation's name, under which transformers finds the ops' attention and
# its (absent) mask.
ATTENTION = "executorch_llm_ops"


def register() -> None:
    """Registers the ops (ExecuTorch's custom-ops library) and their attention with
    transformers; idempotent."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401

    # The ops' shape functions call torch._check_is_size, which torch 2.14 deprecates: a
    # warning at every trace of every op that nobody but ExecuTorch can act on.
    warnings.filterwarnings("ignore", "_check_is_size will be removed", FutureWarning)
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


class LlmOpsLayer(StaticLayer):
    """A static cache layer in the ops' layout, written by `llama::update_cache` from the
    layer's fill count (transformers' forward sets it to the call's first position) and
    returned whole: `_attention` reads it as the ops' layout."""

    def __init__(self, like: StaticLayer) -> None:
        super().__init__(like.max_cache_len)
        batch, heads, slots, _ = like.keys.shape
        self.keys = like.keys.new_zeros(batch, slots, heads, like.k_head_dim)
        self.values = like.values.new_zeros(batch, slots, heads, like.v_head_dim)
        self.cumulative_length = like.cumulative_length
        self.device = like.device
        self.batch_size, self.num_heads = batch, heads
        self.k_head_dim, self.v_head_dim = like.k_head_dim, like.v_head_dim
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = key_states.shape[-2]
        # The fill count modulo the slots, the same number within a session (the positions a
        # session's calls take are all below the slot count). Taken as it is, export's
        # reasoning, which holds a dynamic length to be 2 or more, would bound it from
        # update_cache's own check (start + length <= slots) below the last slot, an assertion
        # of the eager program that a decode step there fails; a remainder it leaves unbounded.
        # (ExecuTorch's edge dialect takes `%`, not torch.sym_min.)
        start = self.cumulative_length.item() % self.max_cache_len
        torch.ops.llama.update_cache(key_states.transpose(1, 2), self.keys, start)
        torch.ops.llama.update_cache(value_states.transpose(1, 2), self.values, start)
        self.cumulative_length.add_(count)
        return self.keys, self.values


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [batch, heads, seq, head_dim], the layer's whole
    cache (LlmOpsLayer's layout) -> [batch, seq, heads, head_dim], causal from the call's first
    position, which its position ids start at."""
    start = kwargs["position_ids"][0, 0].item()
    output = torch.ops.llama.custom_sdpa(
        query.transpose(1, 2), key, value, start, None, 0.0, True, scaling
    )
    return output, None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # custom_sdpa masks causally from its start position itself.
    return None


def update_cache_float64(value: torch.Tensor, cache: torch.Tensor, start: int) -> torch.Tensor:
    """llama::update_cache in plain torch, for float64 caches, which its kernel refuses (it
    takes float32 and the halves): value [batch, count, heads, head_dim] into the cache's slots
    from `start`."""
    cache[:, start : start + value.shape[1]] = value
    return torch.empty(1, dtype=value.dtype)


def custom_sdpa_float64(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    start: int,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """llama::custom_sdpa in plain torch, for float64, causal as the ops' attention calls it:
    query [batch, seq, heads, head_dim] at positions start.. over the cache's slots up to each
    query's own (a grouped cache's heads shared by heads // kv_heads queries each)."""
    count = query.shape[1]
    keys, values = key_cache[:, : start + count], value_cache[:, : start + count]
    groups = query.shape[2] // keys.shape[2]
    keys = keys.repeat_interleave(groups, dim=2).transpose(1, 2)
    values = values.repeat_interleave(groups, dim=2).transpose(1, 2)
    positions = torch.arange(count).unsqueeze(1) + start
    allowed = torch.arange(start + count).unsqueeze(0) <= positions
    output = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), keys, values, attn_mask=allowed, scale=scale
    )
    return output.transpose(1, 2)


# The ops' float64 stand-ins by operator name, for a float64 run of a program that calls them
# (exporter/localize/node_values.py: the oracle of a node).
FLOAT64 = {
    "llama::update_cache": update_cache_float64,
    "llama::custom_sdpa": custom_sdpa_float64,
}
