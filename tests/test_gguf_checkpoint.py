"""model=hf model.checkpoint=FILE.gguf: a tiny Llama written as a GGUF file
(tests/gguf_checkpoint.py) loads as the model that was written and exports with a static KV
cache; files that are no GGUF checkpoint transformers loads are refused when the job is
composed."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from exporter import models
from exporter.cache import keys
from exporter.config import DimBounds, HfConfig, LlamaConfig
from exporter.errors import ConfigError
from tests import gguf_checkpoint
from tests.conftest import CliResult
from tests.test_audit import composed
from tests.test_cli import assert_user_error
from tests.test_localize import job_in_process

SEQ = {"seq": DimBounds(min=1, max=128)}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.LlamaForCausalLM, Path]:
    """The tiny Llama, and the GGUF file it was written to (alone in its directory)."""
    model = gguf_checkpoint.tiny_llama()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return model, gguf_checkpoint.write(model, path)


@pytest.mark.parametrize("named", ["file", "directory"])
def test_the_built_model_computes_the_written_one(written, named: str) -> None:
    model, path = written
    checkpoint = path if named == "file" else path.parent
    bundle = models.build(HfConfig(name="hf", checkpoint=str(checkpoint)), SEQ)
    (ids,) = bundle.make_inputs({"seq": 37}, 0)
    with torch.no_grad():
        built = bundle.module(ids)
        expected = model(input_ids=ids).logits
    assert built.shape == (1, 37, gguf_checkpoint.VOCAB_SIZE)
    # The query and key rows came back from llama.cpp's rotary layout: a row out of place would
    # move logits by about their own size.
    torch.testing.assert_close(built, expected, atol=1e-5, rtol=0)
    # Plain float layers, not transformers' packed GGUF ones.
    assert type(bundle.module.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_model_llama_loads_a_llama_gguf_too(written) -> None:
    model, path = written
    cfg = composed("model=llama", f"model.checkpoint={path}").model
    assert isinstance(cfg, LlamaConfig)
    bundle = models.build(cfg, SEQ)
    assert bundle.module.model.config.num_hidden_layers == model.config.num_hidden_layers


def test_a_gguf_checkpoint_exports_with_a_static_cache_and_answers_a_chat_prompt(
    written, tmp_path: Path
) -> None:
    _, path = written
    record, report = job_in_process(tmp_path, *gguf_checkpoint.chat_job(path))
    assert record.error is None
    assert report["passed"]
    assert {e["shape"]["session"] for e in report["executions"]} == {0, 1, 2}
    assert max(o["ratio"] for e in report["executions"] for o in e["outputs"]) < 4
    greedy = report["greedy"]
    assert greedy["artifact_parts_from_oracle_at"] is None
    # The user's turn in the file's chat template, the assistant's turn opened.
    start, end = gguf_checkpoint.BOS_ID, gguf_checkpoint.EOS_ID
    turn = [start, *b"user\nHi", end, ord("\n"), start, *b"assistant\n"]
    assert greedy["prompt"] == turn
    # 21 prompt tokens leave 11 of the 32 slots to generate in.
    assert len(greedy["artifact"]) == 11
    text = greedy["text"]
    assert text["prompt"] == "Hi"
    for who in ("artifact", "eager", "oracle"):
        assert text[who] == _decoded(greedy[who])


def _decoded(tokens: list[int]) -> str:
    """The tiny vocabulary's tokens as text: a byte each, the special tokens as they are
    spelled."""
    pieces, pending = [], bytearray()
    for token in tokens:
        if token < 256:
            pending.append(token)
            continue
        pieces.append(pending.decode(errors="replace"))
        pending = bytearray()
        pieces.append(gguf_checkpoint.SPECIAL_TOKENS[token - 256])
    pieces.append(pending.decode(errors="replace"))
    return "".join(pieces)


def test_a_prompt_longer_than_a_prefill_is_refused(written, tmp_path: Path) -> None:
    _, path = written
    with pytest.raises(ConfigError, match=r"is 21 tokens .* at most dynamic.seq.max=16: "):
        job_in_process(
            tmp_path,
            "backend=eager",
            "model=hf",
            f"model.checkpoint={path}",
            "model.kv_cache=static",
            "dynamic.seq.max=16",
            "validate.prompt=Hi",
        )


def test_a_prompt_needs_a_checkpoint_with_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"this model has no checkpoint"):
        job_in_process(
            tmp_path,
            "backend=eager",
            "model.num_hidden_layers=1",
            "model.kv_cache=static",
            "dynamic.seq.max=16",
            "validate.prompt=Hi",
        )


def test_a_prompt_needs_a_kv_cache() -> None:
    with pytest.raises(ConfigError, match=r"validate.prompt .* set model.kv_cache=static"):
        composed("validate.prompt=Hi")


def test_the_cache_key_sees_the_gguf_file(written) -> None:
    _, path = written
    assert keys.checkpoint_files(HfConfig(name="hf", checkpoint=str(path))) == [path]


def _header(architecture: str) -> bytes:
    """A GGUF file's header whose general.architecture comes after a string and two arrays (a
    vocabulary and its scores), which the reader steps over."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    strings, floats = 8, 6
    return (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 4)
        + string("general.type")
        + struct.pack("<I", strings)
        + string("model")
        + string("tokenizer.ggml.tokens")
        + struct.pack("<IIQ", 9, strings, 2)
        + string("a")
        + string("bc")
        + string("tokenizer.ggml.scores")
        + struct.pack("<IIQff", 9, floats, 2, 0.5, 1.0)
        + string("general.architecture")
        + struct.pack("<I", strings)
        + string(architecture)
    )


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("model.gguf", b"PK\x03\x04 a zip archive", "not a GGUF file (it does not start with"),
        ("model.gguf", _header("llama")[:30], "its GGUF header is truncated or corrupt"),
        ("model.gguf", b"GGUF" + struct.pack("<I", 1), "GGUF version 1; transformers reads"),
        ("model.gguf", _header("rwkv6"), "GGUF architecture 'rwkv6' is not one transformers"),
        ("model.gguf", _header("t5"), "model_type 't5' has no causal-LM head"),
        ("model.bin", _header("llama"), "a file that is not a .gguf"),
    ],
)
def test_a_file_that_is_no_gguf_checkpoint_is_refused_at_compose(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        composed("model=hf", f"model.checkpoint={path}")
    assert str(refused.value).startswith(f"model.checkpoint={path}: ")
    assert message in str(refused.value)


def test_a_directory_of_two_gguf_files_asks_for_one(tmp_path: Path) -> None:
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).write_bytes(_header("llama"))
    with pytest.raises(ConfigError, match=r"holds 2 GGUF files \(a.Q4_0.gguf, a.Q8_0.gguf\)"):
        composed("model=hf", f"model.checkpoint={tmp_path}")


def test_a_missing_gguf_file_exits_2_at_compose(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=hf", "model.checkpoint=/no/such/model.gguf")
    assert_user_error(result, 2, "model.checkpoint=/no/such/model.gguf: no such directory or file")
