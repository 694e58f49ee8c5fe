"""Checkpoint files are untrusted (issue 41): a GGUF or safetensors file that is truncated, or
whose header declares more than the file has, is refused when the job is composed, before torch
is loaded, in one line naming the file, exit 2; a pickle of weights that would run
code when unpickled is refused as such, never with torch's advice to load it with
weights_only=False. Every file here is written by the test."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exporter import config, models
from exporter.config import DimBounds, HfConfig
from exporter.errors import ConfigError
from tests import gguf_checkpoint
from tests.conftest import PROJECT_ROOT, command_line, composed

TOO_LONG = 2**62

# Runs the command and says, as it exits, whether its process imported torch.
WATCHING_IMPORTS = """
import atexit, sys
atexit.register(lambda: print("torch imported:", "torch" in sys.modules))
sys.argv = ["exporter", *sys.argv[1:]]
from exporter.command import cli
cli.main()
"""


def refused_at_compose(workdir: Path, checkpoint: Path) -> str:
    """`python -m exporter model=hf model.checkpoint=CHECKPOINT`, checked to end at compose:
    exit 2, no traceback, torch not imported, no run dir; its one line of output."""
    overrides = ["model=hf", f"model.checkpoint={checkpoint}", f"hydra.run.dir={workdir}/run"]
    command = [sys.executable, "-c", WATCHING_IMPORTS, *command_line(workdir, *overrides)[3:]]
    # The timeout guards against a reader that believes the file's counts, not a speed target:
    # the refusal ends at compose (torch never imported), which takes about 1.5 s on 2 cores.
    completed = subprocess.run(
        command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output
    assert "Traceback" not in output, output
    assert "torch imported: False" in output, output
    lines = [line for line in output.splitlines() if line and not line.startswith("torch imp")]
    assert len(lines) == 1, output
    assert not (workdir / "run").exists()
    return lines[0]


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


# general.architecture = "llama": a string (type 8).
ARCHITECTURE = gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("llama")


def gguf_header(keys: int, tensors: int, body: bytes) -> bytes:
    """GGUF version 3's magic, version and counts, then `body`."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, keys) + body


def test_a_gguf_string_longer_than_the_file_is_refused_at_compose(tmp_path: Path) -> None:
    # Issue 41, 1: a key's name of 2^62 bytes, which the reader allocated (a MemoryError).
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_header(1, 0, struct.pack("<Q", TOO_LONG) + b"x" * 100))
    line = refused_at_compose(tmp_path, path)
    assert line == (
        f"[config] model.checkpoint={path}: its GGUF header is truncated or corrupt: reading "
        f"the name of key 1 at byte 32 takes {TOO_LONG} bytes, and the file has 132; download "
        "or convert the file again."
    )


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A whole GGUF file of the tiny Llama, with its tokenizer."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return gguf_checkpoint.write(gguf_checkpoint.tiny_llama(), path).read_bytes()


@pytest.mark.parametrize(
    ("kept", "message"),
    [
        # Issue 41, 2: the header's start, which composing accepted and the model stage failed
        # on (exit 6, "unpack_from requires a buffer of at least 1026 bytes").
        (
            1024,
            "its GGUF header is truncated or corrupt: reading the value of key tokenizer.ggml.",
        ),
        # The header whole, the last tensor's bytes cut short.
        (-100, "its GGUF tensor data is truncated or corrupt: tensor blk.1.ffn_down.weight (F32)"),
    ],
)
def test_a_truncated_gguf_file_is_refused_at_compose(
    tmp_path: Path, gguf_file: bytes, kept: int, message: str
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_file[:kept])
    line = refused_at_compose(tmp_path, path)
    assert line.startswith(f"[config] model.checkpoint={path}: {message}")
    assert line.endswith(
        f"and the file has {path.stat().st_size}; download or convert the file again."
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            gguf_header(TOO_LONG, 0, ARCHITECTURE),
            f"reading the keys ({TOO_LONG}) at byte 24 takes at least {13 * TOO_LONG} bytes",
        ),
        (
            gguf_header(
                2,
                0,
                ARCHITECTURE
                + gguf_string("tokenizer.ggml.tokens")
                + struct.pack("<IIQ", 9, 8, 2**40),
            ),
            f"the value of key tokenizer.ggml.tokens ({2**40} strings) at byte 114 takes at least",
        ),
        (
            gguf_header(1, TOO_LONG, ARCHITECTURE),
            f"reading the tensor entries ({TOO_LONG}) at byte 69 takes at least",
        ),
        (
            gguf_header(
                1, 1, ARCHITECTURE + gguf_string("t") + struct.pack("<I", 2**31) + bytes(64)
            ),
            "tensor t has 2147483648 dimensions; GGUF allows 4",
        ),
        (
            gguf_header(
                1,
                1,
                ARCHITECTURE + gguf_string("t") + struct.pack("<IQQIQ", 2, *(2**40,) * 2, 0, 0),
            ),
            "its GGUF tensor data is truncated or corrupt: tensor t (F32) needs bytes 128 to",
        ),
    ],
    ids=["keys", "array items", "tensors", "dimensions", "tensor bytes"],
)
def test_a_gguf_count_the_file_cannot_hold_is_refused_at_once(
    tmp_path: Path, body: bytes, message: str
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(body)
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        config.to_job(composed("model=hf", f"model.checkpoint={path}"))
    # A guard against reading or allocating what the counts declare, not a speed target.
    assert time.monotonic() - started < 30
    assert str(refused.value).startswith(f"model.checkpoint={path}: ")
    assert message in str(refused.value)


@pytest.fixture(scope="module")
def safetensors_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama written by save_pretrained(): config.json, model.safetensors."""
    directory = tmp_path_factory.mktemp("safetensors")
    gguf_checkpoint.tiny_llama().save_pretrained(directory)
    return directory


def copied(checkpoint: Path, into: Path) -> Path:
    into.mkdir()
    for file in checkpoint.iterdir():
        (into / file.name).write_bytes(file.read_bytes())
    return into


def test_a_truncated_safetensors_file_is_refused_at_compose(
    tmp_path: Path, safetensors_checkpoint: Path
) -> None:
    checkpoint = copied(safetensors_checkpoint, tmp_path / "checkpoint")
    weights = checkpoint / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    line = refused_at_compose(tmp_path, checkpoint)
    assert line.startswith(
        f"[config] model.checkpoint={checkpoint}: model.safetensors is truncated or corrupt: "
        "tensor "
    )
    assert line.endswith("download or save the checkpoint again.")


def test_a_whole_safetensors_checkpoint_is_accepted(safetensors_checkpoint: Path) -> None:
    config.to_job(composed("model=hf", f"model.checkpoint={safetensors_checkpoint}"))


def _header_length(whole: bytes) -> int:
    return struct.unpack("<Q", whole[:8])[0]


@pytest.mark.parametrize(
    ("corrupted", "message"),
    [
        (
            lambda whole: struct.pack("<Q", TOO_LONG) + whole[8:],
            f"its header's length is {TOO_LONG}",
        ),
        (lambda whole: whole[:8] + b"[" + whole[9:], "its header is not JSON"),
        (lambda whole: whole.replace(b'"F32"', b'"F16"', 1), "bytes, and its offsets span"),
        (lambda whole: whole + b"\0" * 8, "its tensors end at byte"),
    ],
    ids=["header length", "header JSON", "tensor size", "bytes after the tensors"],
)
def test_a_corrupt_safetensors_file_is_refused_at_once(
    tmp_path: Path, safetensors_checkpoint: Path, corrupted, message: str
) -> None:
    checkpoint = copied(safetensors_checkpoint, tmp_path / "checkpoint")
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(corrupted(weights.read_bytes()))
    with pytest.raises(ConfigError) as refused:
        config.to_job(composed("model=hf", f"model.checkpoint={checkpoint}"))
    assert str(refused.value).startswith(
        f"model.checkpoint={checkpoint}: model.safetensors is truncated or corrupt: "
    )
    assert message in str(refused.value)


class RunsCode:
    """Unpickled, it runs a shell command: it touches `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def pickle_checkpoint(directory: Path, write) -> Path:
    """A save_pretrained() directory of the tiny Llama whose weights are pytorch_model.bin, as
    `write(state_dict, path)` writes them."""
    model = gguf_checkpoint.tiny_llama()
    model.config.save_pretrained(directory)
    write(dict(model.state_dict()), directory / "pytorch_model.bin")
    return directory


@pytest.mark.parametrize(
    ("write", "imported"),
    [
        # torch.save()'s zip archive, protocol 2: GLOBAL posix system.
        (torch.save, "posix.system"),
        # A plain pickle of protocol 5: STACK_GLOBAL, of the two strings pushed before it.
        (lambda state, path: path.write_bytes(pickle.dumps(state, protocol=5)), "posix.system"),
    ],
    ids=["torch.save", "pickle protocol 5"],
)
def test_a_pickle_that_would_run_code_is_refused_at_compose(
    tmp_path: Path, write, imported: str
) -> None:
    # Issue 41, 3: refused by torch at the model stage (exit 6), with its advice to rerun with
    # weights_only=False.
    marker = tmp_path / "ran"

    def with_code(state: dict, path: Path) -> None:
        write({**state, "lm_head.bias": RunsCode(marker)}, path)

    checkpoint = pickle_checkpoint(tmp_path / "checkpoint", with_code)
    line = refused_at_compose(tmp_path, checkpoint)
    assert line == (
        f"[config] model.checkpoint={checkpoint}: refused pytorch_model.bin: unpickling it would "
        f"run code (it imports {imported}, which no state dict holds); model=hf loads weights, "
        "never code. Use the checkpoint's safetensors weights (model.safetensors) instead."
    )
    assert not marker.exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip archive", "format before 1.6"])
def test_a_pickle_of_a_state_dict_is_accepted(tmp_path: Path, zipped: bool) -> None:
    def write(state: dict, path: Path) -> None:
        torch.save(state, path, _use_new_zipfile_serialization=zipped)

    checkpoint = pickle_checkpoint(tmp_path / "checkpoint", write)
    config.to_job(composed("model=hf", f"model.checkpoint={checkpoint}"))


def test_a_pickle_torch_refuses_is_refused_without_torchs_advice(tmp_path: Path) -> None:
    # A module, not a tensor: torch's own name (torch.nn.modules.linear.Linear), which the
    # composed check lets through and torch.load(weights_only=True) refuses, advising
    # weights_only=False.
    def with_module(state: dict, path: Path) -> None:
        torch.save({**state, "lm_head": torch.nn.Linear(2, 2)}, path)

    checkpoint = pickle_checkpoint(tmp_path / "checkpoint", with_module)
    cfg = HfConfig(name="hf", checkpoint=str(checkpoint))
    with pytest.raises(ConfigError) as refused:
        models.build(cfg, {"seq": DimBounds(min=1, max=128)})
    message = str(refused.value)
    assert message.startswith(
        f"model.checkpoint={checkpoint}: refused pytorch_model.bin: unpickling it would run code"
    )
    assert "weights_only" not in message
    assert "\n" not in message
