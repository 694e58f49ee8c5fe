"""What transformers' causal LMs share: token ids [1, seq] -> logits [1, seq, vocab], or with a
static KV cache, token ids [1, seq] and their cache positions [seq] -> logits, the cache held as
mutable buffers of the program (the signature of ExecuTorch's LLM runners and
optimum-executorch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

from exporter.config import CausalLmConfig, KvCache
from exporter.errors import ConfigError
from exporter.models import llm_ops
from exporter.models.bundle import Decoder, ModelDeclaration


class LogitsOnly(torch.nn.Module):
    """Token ids in, logits out, no KV cache: the signature export and every runtime see."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class StaticCacheLM(TorchExportableModuleWithStaticCache):
    """transformers' static-cache module for export: its cache layers' keys and values are the
    module's buffers (key_cache_N, value_cache_N), so export makes them the program's mutable
    buffers. Each call writes its keys and values at `cache_position`'s slots, which must follow
    on from the call before within a session (a new session starts at 0)."""

    def __init__(self, model: PreTrainedModel, max_cache_len: int) -> None:
        model.generation_config.use_cache = True
        model.generation_config.cache_implementation = "static"
        super().__init__(model, batch_size=1, max_cache_len=max_cache_len, device="cpu")

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, cache_position=cache_position)

    def _apply(self, fn, recurse=True):
        # Moving or casting the module replaces its buffers; the cache layers computed with the
        # tensors they were made with, which would no longer be the buffers export and the
        # runtimes see.
        super()._apply(fn, recurse)
        for index, layer in enumerate(self.static_cache.layers):
            layer.keys = self._buffers[f"key_cache_{index}"]
            layer.values = self._buffers[f"value_cache_{index}"]
            layer.cumulative_length = self._buffers[f"cumulative_length_{index}"]
            layer.device = layer.keys.device
        return self


class LlmOpsCacheLM(StaticCacheLM):
    """StaticCacheLM whose cache ExecuTorch's LLM ops write and read (exporter/models/llm_ops.py):
    the same buffers, in the ops' layout."""

    def __init__(self, model: PreTrainedModel, max_cache_len: int) -> None:
        super().__init__(model, max_cache_len)
        llm_ops.register()
        for index, layer in enumerate(self.static_cache.layers):
            self.static_cache.layers[index] = replaced = llm_ops.LlmOpsLayer(layer)
            self.register_buffer(f"key_cache_{index}", replaced.keys, persistent=False)
            self.register_buffer(f"value_cache_{index}", replaced.values, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = llm_ops.ATTENTION
        try:
            return super().forward(input_ids, cache_position)
        finally:
            config._attn_implementation = previous


def declare_causal_lm(
    model: PreTrainedModel,
    max_positions: int | None,
    max_cache_len: int | None = None,
    tokenizer: Callable[[], Any] | None = None,
) -> ModelDeclaration:
    """`model` behind LogitsOnly, fed token ids drawn from its vocabulary; `max_positions` bounds
    `seq` (None: the model sets no limit of its own). With `max_cache_len`, behind StaticCacheLM
    with that many cache slots instead: the inputs are a prefill from position 0, and
    `tokenizer` (Decoder.tokenizer) loads the checkpoint's tokenizer."""
    vocab_size = model.config.vocab_size
    if max_cache_len is None:

        def make_inputs(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
            generator = torch.Generator().manual_seed(seed)
            return (torch.randint(0, vocab_size, (1, sizes["seq"]), generator=generator),)

        return ModelDeclaration(
            module=LogitsOnly(model).eval(),
            input_names=("input_ids",),
            output_names=("logits",),
            dim_axes={"seq": (("input_ids", 1),)},
            dim_limits={} if max_positions is None else {"seq": max_positions},
            make_inputs=make_inputs,
            logits_outputs=("logits",),
        )

    if max_positions is not None and max_cache_len > max_positions:
        raise ConfigError(
            f"model.max_cache_len is {max_cache_len}, beyond the model's {max_positions} "
            f"positions; allowed: 2..{max_positions}."
        )
    try:
        module = StaticCacheLM(model, max_cache_len)
    except (AttributeError, TypeError, ValueError) as error:
        # transformers' StaticCache is made of attention layers' keys and values, from the
        # config's head counts: a recurrent state (Mamba, RecurrentGemma's linear attention)
        # has neither, and the cache fails to build, with an AttributeError from deep inside.
        raise ConfigError(
            f"model.kv_cache=static: transformers {transformers.__version__} cannot build a "
            f"static KV cache for {type(model).__name__} ({model.config.model_type}): "
            f"{type(error).__name__}: {error}. Export it with model.kv_cache=none."
        ) from error
    return declare_cached(
        module,
        Decoder(
            max_cache_len=max_cache_len,
            vocab_size=vocab_size,
            layers=model.config.get_text_config().num_hidden_layers,
            uncached=LogitsOnly(model).eval(),
            bos_id=model.config.bos_token_id,
            eos_ids=eos_ids(model),
            tokenizer=tokenizer,
        ),
    )


def declare_cached(module: torch.nn.Module, decoder: Decoder) -> ModelDeclaration:
    """A decoder with a static cache of `decoder.max_cache_len` slots as every stage sees it:
    token ids and their cache positions in (a prefill from position 0 where export draws
    them), logits out, `seq` their one dim. The module's own buffers are its state (the cache,
    and what an encode method writes): Decoder.cache_buffers."""
    vocab_size = decoder.vocab_size
    decoder = dataclasses.replace(
        decoder, cache_buffers=tuple(name for name, _ in module.named_buffers(recurse=False))
    )

    def make_prefill(sizes: Mapping[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (1, sizes["seq"]), generator=generator)
        return tokens, torch.arange(sizes["seq"])

    return ModelDeclaration(
        module=module.eval(),
        input_names=("input_ids", "cache_position"),
        output_names=("logits",),
        dim_axes={"seq": (("input_ids", 1), ("cache_position", 0))},
        dim_limits={"seq": decoder.max_cache_len},
        make_inputs=make_prefill,
        logits_outputs=("logits",),
        decoder=decoder,
        # The cache's in-place writes become mutable buffers only in strict export (torch
        # 2.14: non-strict export keeps them out of the program's signature, and lowering then
        # fails).
        export_strict=True,
    )


def with_llm_ops(declaration: ModelDeclaration) -> tuple[ModelDeclaration, str | None]:
    """The declaration with its cache written and read by ExecuTorch's LLM ops (LlmOpsCacheLM)
    and why not where they do not fit its model: then the declaration is returned unchanged
    with the reason. A declaration without StaticCacheLM's cache (a custom factory's) has
    nothing to change."""
    module, decoder = declaration.module, declaration.decoder
    if not isinstance(module, StaticCacheLM) or decoder is None:
        return declaration, None
    if decoder.encoding is not None:
        return declaration, (
            "its decoder reads what an encode method wrote (an image's features), which "
            "LlmOpsCacheLM's forward does not"
        )
    model = module.model
    misfit = _llm_ops_misfit(model, decoder.max_cache_len)
    if misfit:
        return declaration, misfit
    custom = LlmOpsCacheLM(model, decoder.max_cache_len).eval()
    misfit = _trial_misfit(custom, module)
    if misfit:
        return declaration, misfit
    return dataclasses.replace(
        declaration, module=custom, decoder=dataclasses.replace(decoder, llm_ops=True)
    ), None


def _llm_ops_misfit(model: PreTrainedModel, slots: int) -> str | None:
    """What keeps `custom_sdpa` (causal attention over the filled slots, no mask, no softcap)
    from computing the model's attention, as far as its config says."""
    config = model.config.get_text_config()
    attention = model.config._attn_implementation
    if attention != "sdpa":
        return (
            f"its attention is transformers' {attention!r} (custom_sdpa stands in for 'sdpa' "
            "only: the model computes what sdpa does not, as softcapped scores)"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and window < slots:
        return f"its sliding window of {window} tokens is shorter than the cache's {slots} slots"
    return None


# A prefill and a decode step: enough to see a model call the ops as they are meant.
_TRIAL_TOKENS = 3


def _trial_misfit(custom: LlmOpsCacheLM, plain: StaticCacheLM) -> str | None:
    """Runs a prefill and a decode step through both modules: the ops do not fit where the
    custom one fails or computes other logits than the plain one (beyond rounding: 1% of the
    logits' range, where a misplaced key is a wholly different attention). Both caches are
    emptied after."""
    tokens = torch.arange(_TRIAL_TOKENS).unsqueeze(0)
    calls = [(tokens[:, :-1], torch.arange(_TRIAL_TOKENS - 1))]
    calls.append((tokens[:, -1:], torch.tensor([_TRIAL_TOKENS - 1])))
    try:
        with torch.no_grad():
            got = torch.cat([custom(*call) for call in calls], dim=1).float()
            expected = torch.cat([plain(*call) for call in calls], dim=1).float()
    # Any failure of the model's code under the ops says they do not fit it.
    except Exception as error:
        return f"a trial call with them failed: {type(error).__name__}: {error}"
    finally:
        for module in (custom, plain):
            for buffer in module.buffers(recurse=False):
                buffer.zero_()
    scale = float(expected.abs().max()) or 1.0
    difference = float((got - expected).abs().max())
    if not difference <= 0.01 * scale:
        return (
            f"a trial prefill and decode step with them differ from transformers' by "
            f"{difference:.3g} (logits up to {scale:.3g})"
        )
    return None


def cache_slots(cfg: CausalLmConfig) -> int | None:
    """The cache's slots where the model is exported with one (models.build filled in the
    default), else None."""
    return cfg.max_cache_len if cfg.kv_cache is KvCache.static else None


def eos_ids(model: PreTrainedModel) -> tuple[int, ...]:
    """The ids generation stops at: the config's EOS, then those its generation config adds (an
    instruct model's end of turn, which transformers' generate stops at too), each once."""
    found: list[int] = []
    generation = getattr(model, "generation_config", None)
    # A vision-language model's config holds its language model's (text_config).
    config = model.config.get_text_config()
    for eos in (config.eos_token_id, getattr(generation, "eos_token_id", None)):
        for token in [] if eos is None else [eos] if isinstance(eos, int) else eos:
            if token not in found:
                found.append(token)
    return tuple(found)
