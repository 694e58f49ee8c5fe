"""What the model stage hands on: the module, its inputs, and its dynamic dims with their bounds."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exporter.config import DimMode, ModelDtype
from exporter.errors import ConfigError

if TYPE_CHECKING:
    from exporter.models.gguf_codes import FileQuantization


@dataclass(frozen=True)
class DynamicDim:
    """A named dim, the input axes that carry it, its configured bounds and how export sees it."""

    name: str
    axes: tuple[tuple[str, int], ...]
    min: int
    max: int
    mode: DimMode = DimMode.backed

    @property
    def is_static(self) -> bool:
        return self.min == self.max


# Sizes of every dynamic dim and a seed -> the model's positional inputs at those sizes.
InputMaker = Callable[[Mapping[str, int], int], tuple[torch.Tensor, ...]]
# A program's metadata by name: an int, a flag or a list of ints each.
RunnerMetadata = dict[str, int | bool | list[int]]


@dataclass(frozen=True)
class Encoding:
    """What a decoder attends to besides its tokens (Whisper's clip of audio, SmolVLM's image),
    encoded once per session: `module` is the encode method as torch.export takes it, writing
    the decoder's state (buffers named as the decoder's module names them); `make_input(seed)`
    draws one input of it (a session's clip or image) of `input_shape`, `input_name` its name;
    `prompt` is what the decoder starts from once it is encoded (Whisper's start of transcript,
    then its language and task where it is multilingual, and no timestamps; SmolVLM's image
    tokens). `placeholders` are the tokens that stand for the encoded input in the sequence
    (SmolVLM's image tokens), which every session holds once, after its first token; none where
    the decoder attends to it apart (Whisper's cross-attention)."""

    module: torch.nn.Module
    input_name: str
    input_shape: tuple[int, ...]
    make_input: Callable[[int], torch.Tensor]
    prompt: tuple[int, ...]
    placeholders: tuple[int, ...] = ()


def encode_as_forward(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its `encode` method as its forward, over the same parameters and buffers
    under the same names: what torch.export takes for the encode method (Encoding.module), so
    that the two programs name their shared state alike."""
    kind = type(module)
    view = copy.copy(module)
    view.__class__ = type(f"{kind.__name__}Encode", (kind,), {"forward": kind.encode})
    return view


@dataclass(frozen=True)
class Decoder:
    """What a causal LM exported with a static KV cache tells the stages after it: the cache's
    slots, the vocabulary, its layers, the checkpoint's BOS and EOS tokens where it has them, and
    the same model without a cache (token ids -> logits over the whole sequence), which the
    float64 oracle runs so that it shares no code with the cache. `tokenizer` loads the
    checkpoint's tokenizer (transformers'; it raises ConfigError saying why where there is none),
    which validate.prompt needs; None: the model has no checkpoint."""

    max_cache_len: int
    vocab_size: int
    layers: int
    uncached: torch.nn.Module
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    tokenizer: Callable[[], Any] | None = None
    # The module's buffers that hold the cache: state the program writes as it runs, not
    # weights (the weights audit skips them). The program cannot say: torch.export keeps the
    # cache's writes in place (index_copy_), and its signature lists no buffer mutation.
    # declare_cached fills it in with the module's own buffers.
    cache_buffers: tuple[str, ...] = ()
    # Encoded once per session before its tokens (the sessions' `encoded`), and the oracle's
    # `uncached(tokens, encoded)` reads it too; None: a decoder of tokens alone.
    encoding: Encoding | None = None
    # The program writes and reads its cache with ExecuTorch's LLM ops
    # (exporter/models/llm_ops.py), which a runtime registers before it loads the program.
    llm_ops: bool = False

    def runner_metadata(self, seq: DynamicDim) -> RunnerMetadata:
        """What an LLM runner reads of the program before running it, under the names of
        ExecuTorch's runners (extension/llm/runner/constants.h): the longest call (`seq`'s
        max), the cache's slots, the vocabulary, the layers, a KV cache, whether ExecuTorch's
        SDPA-with-cache op reads it (`llm_ops`), whether the call's length is dynamic, and
        BOS/EOS where the checkpoint has them; a decoder of an encoded input adds that input's
        shape and the decoder's prompt (Encoding), which a target's transcription reads."""
        metadata: RunnerMetadata = {
            "get_max_seq_len": seq.max,
            "get_max_context_len": self.max_cache_len,
            "get_vocab_size": self.vocab_size,
            "get_n_layers": self.layers,
            "use_kv_cache": True,
            "use_sdpa_with_kv_cache": self.llm_ops,
            "enable_dynamic_shape": not seq.is_static,
        }
        if self.bos_id is not None:
            metadata["get_bos_id"] = self.bos_id
        if self.eos_ids:
            metadata["get_eos_ids"] = list(self.eos_ids)
        if self.encoding is not None:
            metadata["get_encoder_input_shape"] = list(self.encoding.input_shape)
            metadata["get_decoder_prompt_ids"] = list(self.encoding.prompt)
        return metadata


@dataclass(frozen=True)
class ModelBundle:
    name: str
    module: torch.nn.Module
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dims: tuple[DynamicDim, ...]
    make_inputs: InputMaker
    # The outputs that are next-token logits (vocabulary on the last axis): a causal LM's.
    logits_outputs: tuple[str, ...] = ()
    # A causal LM with a static KV cache: validated by sessions of prefill and decode steps.
    decoder: Decoder | None = None
    # Export with torch.export's strict (TorchDynamo) tracing.
    export_strict: bool = False
    # A quantized model's float original (exporter/quantize/), which the quality verdict
    # compares it with; None: the model is not quantized.
    unquantized: ModelBundle | None = None
    # Reads what the checkpoint stored quantized (a GGUF file's codes), for quantize=auto to
    # carry; None: the checkpoint stored floats.
    file_quantization: Callable[[], FileQuantization] | None = None
    # As ModelDeclaration's.
    preprocessor: Callable[[Path], object] | None = None

    def max_sizes(self) -> dict[str, int]:
        return {dim.name: dim.max for dim in self.dims}

    def bounded_by(self, artifact: str, sizes: Sequence[tuple[int, ...] | None]) -> ModelBundle:
        """The bundle with each dynamic dim's max lowered to what a given artifact's inputs hold
        (`sizes`, its inputs' largest sizes in order), so that no live shape asks it for more;
        ConfigError where it holds less than a dim's min."""
        dims = []
        for dim in self.dims:
            held = [
                (sizes[self.input_names.index(name)] or ())[axis]
                for name, axis in dim.axes
                if len(sizes[self.input_names.index(name)] or ()) > axis
            ]
            top = min(held, default=dim.max)
            if top < dim.min:
                raise ConfigError(
                    f"artifact={artifact}: its inputs hold {dim.name} up to {top}, below "
                    f"dynamic.{dim.name}.min={dim.min}; validate it with dynamic.{dim.name}.min "
                    f"and max at most {top}, or export it again with the job's bounds."
                )
            dims.append(replace(dim, max=min(dim.max, top)))
        return replace(self, dims=tuple(dims))

    def runner_metadata(self) -> RunnerMetadata:
        """What an LLM runner reads of the program (a model with a KV cache; else nothing)."""
        if self.decoder is None:
            return {}
        (seq,) = self.dims
        return self.decoder.runner_metadata(seq)


@dataclass(frozen=True)
class ModelDeclaration:
    """What a model builder knows before bounds are applied: which axes are dynamic, and limits.

    `dim_limits` holds the model's own largest size per dim (a Llama's max_position_embeddings).
    """

    module: torch.nn.Module
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dim_axes: Mapping[str, tuple[tuple[str, int], ...]]
    dim_limits: Mapping[str, int]
    make_inputs: InputMaker
    # The outputs that are next-token logits (vocabulary on the last axis), whose predictions
    # validation measures beside their values (top-1 agreement, KL divergence).
    logits_outputs: tuple[str, ...] = ()
    decoder: Decoder | None = None
    export_strict: bool = False
    file_quantization: Callable[[], FileQuantization] | None = None
    # Writes into the folder it is given what a target turns raw inputs into the model's with
    # (an image classifier's image processor, and its labels; a vision-language model's image
    # processor settings); None where the model has none.
    preprocessor: Callable[[Path], object] | None = None


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes the module's parameters and buffers hold, each storage counted once: tied
    weights (an output projection sharing the token embedding's) and views share one."""
    tensors = [*module.parameters(), *module.buffers()]
    storages: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers (non-persistent ones too) by fully qualified name,
    as torch.export names them in its program."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def torch_dtype(dtype: ModelDtype) -> torch.dtype:
    return getattr(torch, dtype.value)
