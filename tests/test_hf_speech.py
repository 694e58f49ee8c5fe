"""Whisper (exporter/models/hf_speech.py): `encode` plus a decoder with a static cache computes
transformers' logits in a prefill and in decode steps, both methods export, and a Whisper
checkpoint's job judges every decode step of sessions that each start with a clip of their own,
through eager and AOTInductor, where an encode method that writes another cache fails them."""

from __future__ import annotations

import json
import wave
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from executorch.runtime import Runtime
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.export.pt2_archive._package import load_pt2
from transformers import PreTrainedTokenizerFast, WhisperConfig, WhisperForConditionalGeneration

from exporter.backends import aoti
from exporter.config import to_job
from exporter.errors import ConfigError
from exporter.models.bundle import encode_as_forward
from exporter.models.hf_speech import WhisperCacheLM, prompt_of, tones
from runtimes import audio, run
from tests.conftest import composed, job_in_process

SMALL = WhisperConfig(
    vocab_size=96,
    num_mel_bins=80,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_source_positions=1500,
    max_target_positions=32,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
    decoder_start_token_id=1,
)


def test_encode_then_prefill_and_decode_steps_are_transformers_logits() -> None:
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(SMALL).eval()
    whisper = WhisperCacheLM(model, slots=16).eval()
    features = torch.randn(1, 80, 3000)
    tokens = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        expected = model(input_features=features, decoder_input_ids=tokens).logits
        whisper.encode(features)
        prefill = whisper(tokens[:, :5], torch.arange(5))
        steps = [whisper(tokens[:, i : i + 1], torch.tensor([i])) for i in range(5, 9)]
    torch.testing.assert_close(torch.cat([prefill, *steps], 1), expected, atol=1e-6, rtol=0)


def test_both_methods_export_and_the_decoder_reads_what_encode_wrote() -> None:
    torch.manual_seed(0)
    whisper = WhisperCacheLM(WhisperForConditionalGeneration(SMALL).eval(), slots=16).eval()
    features = torch.randn(1, 80, 3000)
    tokens = torch.randint(0, 96, (1, 5))
    seq = torch.export.Dim("seq", min=1, max=16)
    encode = torch.export.export(encode_as_forward(whisper), (features,), strict=True)
    decode = torch.export.export(
        whisper, (tokens, torch.arange(5)), dynamic_shapes=({1: seq}, {0: seq}), strict=True
    )
    with torch.no_grad():
        whisper.encode(features)
        expected = whisper(tokens, torch.arange(5))
        for buffer in whisper.buffers():
            buffer.zero_()
        encode.module()(features)
        actual = decode.module()(tokens, torch.arange(5))
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)
    # The methods name their shared state alike, as ExecuTorch's share_mutable_buffers needs.
    assert set(encode.constants) <= set(decode.constants)


@pytest.fixture(scope="module")
def whisper_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("whisper")
    torch.manual_seed(0)
    WhisperForConditionalGeneration(SMALL).save_pretrained(directory)
    # A word per id, so that a transcript reads as the ids the decoder chose.
    vocab = {f"w{index}": index for index in range(SMALL.vocab_size)}
    vocab["<|endoftext|>"] = 0
    del vocab["w0"]
    words = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=words,
        eos_token="<|endoftext|>",
    ).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def eager_job(whisper_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    run_dir = tmp_path_factory.mktemp("whisper-eager")
    return run_dir, *job_in_process(run_dir, *encoded_job(whisper_checkpoint, "backend=eager"))


def encoded_job(checkpoint: Path, *overrides: str) -> tuple[str, ...]:
    """The overrides of a job of a model with an encode method (Whisper's, SmolVLM's): 16 cache
    slots, prefills of 1 to 8 tokens."""
    return (
        "model=hf",
        f"model.checkpoint={checkpoint}",
        "model.kv_cache=static",
        "model.max_cache_len=16",
        "dynamic.seq.max=8",
        *overrides,
    )


@pytest.fixture(scope="module")
def aoti_job(whisper_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    run_dir = tmp_path_factory.mktemp("whisper-aoti")
    return run_dir, *job_in_process(run_dir, *encoded_job(whisper_checkpoint, "backend=aoti"))


def _assert_every_step_passed(report: dict) -> None:
    steps = [e["shape"] for e in report["executions"]]
    # Three sessions (prefills 1, 5 and 8), each with a clip of its own, judged to the last slot.
    assert {s["session"] for s in steps} == {0, 1, 2}
    assert {s["session"] for s in steps if s["pos"] == 15} == {0, 1, 2}
    assert all(e["passed"] for e in report["executions"])
    assert max(o["ratio"] for e in report["executions"] for o in e["outputs"]) < 4
    greedy = report["greedy"]
    # A transcription of the first clip from the start of transcript, to the last slot.
    assert greedy["artifact"] == greedy["eager"] == greedy["oracle"]
    assert greedy["prompt"] == [1] and len(greedy["oracle"]) == 15


def test_a_whisper_checkpoint_is_judged_at_every_decode_step_after_its_clip(
    eager_job: tuple,
) -> None:
    run_dir, record, report = eager_job
    assert record.error is None
    _assert_every_step_passed(report)
    goldens = torch.load(run_dir / "bundle" / "goldens.pt", weights_only=True)
    clips = [session["encoded"] for session in goldens["sessions"]]
    # Each session's clip is its own: features of tones, not one input reused.
    assert [tuple(c.shape) for c in clips] == [(1, 80, 3000)] * 3
    assert not torch.equal(clips[0], clips[1]) and not torch.equal(clips[1], clips[2])
    # program.pt2 holds each weight once: the model's program the decoder's, the encode
    # program the encoder's (and the decoder's cross-attention keys and values).
    programs = load_pt2(run_dir / "program.pt2").exported_programs
    model, encode = set(programs["model"].state_dict), set(programs["encode"].state_dict)
    assert not model & encode
    assert all(".decoder." in name or name.startswith("model.proj_out") for name in model)
    assert any(".encoder." in name for name in encode)
    assert report["weights_audit"]["checked"] == len(model | encode)
    assert not report["weights_audit"]["mismatched"] and not report["weights_audit"]["unseen"]


def test_transcribe_prints_the_text_of_eagers_greedy_tokens_for_a_wav_file(
    eager_job: tuple, whisper_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    clip = tmp_path / "clip.wav"
    with wave.open(str(clip), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(audio.SAMPLE_RATE)
        file.writeframes((tones(11) * 32767).astype(np.int16).tobytes())
    assert run.main([str(eager_job[0] / "bundle"), "transcribe", str(clip)]) == 0
    printed = capfd.readouterr().out.splitlines()
    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint).eval()
    whisper = WhisperCacheLM(model, slots=16).eval()
    features = torch.from_numpy(audio.log_mel(audio.read_wav(clip))).unsqueeze(0)
    tokens, position = [1], 0
    with torch.no_grad():
        whisper.encode(features)
        while len(tokens) < 16:
            logits = whisper(torch.tensor([tokens[position:]]), torch.arange(position, len(tokens)))
            position = len(tokens)
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == 0:
                break
    expected = " ".join(f"w{token}" for token in tokens[1:] if token != 0)
    assert expected and printed[1] == expected
    assert printed[2].startswith("[transcribe] encode ")
    assert run.main([str(eager_job[0] / "bundle"), "transcribe", str(whisper_checkpoint)]) == 2


@pytest.mark.slow
def test_whisper_through_aoti_shares_the_cross_attention_cache_and_passes(aoti_job: tuple) -> None:
    run_dir, record, report = aoti_job
    assert record.error is None
    _assert_every_step_passed(report)
    with zipfile.ZipFile(run_dir / "model.pt2") as archive:
        names = archive.namelist()
    assert any("/encode/" in name for name in names) and any("/model/" in name for name in names)


@pytest.mark.slow
def test_whisper_through_executorch_shares_the_cross_attention_cache_and_passes(
    whisper_checkpoint: Path, tmp_path: Path
) -> None:
    record, report = job_in_process(
        tmp_path, *encoded_job(whisper_checkpoint, "backend=executorch")
    )
    assert record.error is None
    _assert_every_step_passed(report)
    program = Runtime.get().load_program(tmp_path / "model.pte")
    assert program.method_names >= {"forward", "encode"}


@pytest.mark.slow
def test_an_encode_method_over_a_cache_of_its_own_fails_every_step(
    whisper_checkpoint: Path, aoti_job: tuple, tmp_path: Path
) -> None:
    # The fault the shared state prevents: an encode method loaded apart writes a
    # cross-attention cache that the decoder never reads, so it attends to zeros at every step.
    faulty = encode_apart(aoti_job[0] / "program.pt2", tmp_path / "model.pt2")
    record, report = job_in_process(
        tmp_path / "run", *encoded_job(whisper_checkpoint, "backend=aoti", f"artifact={faulty}")
    )
    assert record.error is not None
    assert len(report["executions"]) == 26 and not any(e["passed"] for e in report["executions"])
    # The search for the first diverging node cuts the decoder alone: it says why it did not run.
    assert "start with its encode method" in record.localization.reason


def encode_apart(program_file: Path, package: Path) -> Path:
    """An AOTInductor package of `program_file`'s programs whose encode model was loaded apart
    from the decoder's: it writes state of its own, which the decoder never reads."""
    model = load_pt2(program_file).exported_programs["model"]
    apart = load_pt2(program_file).exported_programs["encode"]
    aoti.package(model, package, encode=apart)
    return package


def test_the_transcription_prompt_is_the_checkpoints_and_features_come_in_float32(
    tmp_path: Path,
) -> None:
    model = WhisperForConditionalGeneration(SMALL).eval()
    assert prompt_of(model, tmp_path) == (1,)
    generation = {
        "is_multilingual": True,
        "lang_to_id": {"<|de|>": 4, "<|en|>": 5},
        "task_to_id": {"transcribe": 7, "translate": 6},
        "no_timestamps_token_id": 9,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert prompt_of(model, tmp_path) == (1, 5, 7, 9)
    # A bfloat16 model's encode method takes the float32 features a target computes.
    whisper = WhisperCacheLM(model.to(torch.bfloat16), slots=16).eval()
    with torch.no_grad():
        states = whisper.encode(torch.randn(1, 80, 3000))
    assert states.dtype == torch.bfloat16 and whisper.cross_keys_0.abs().sum() > 0


def test_a_whisper_checkpoint_needs_a_static_cache_and_a_backend_with_two_methods(
    whisper_checkpoint: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"add model\.kv_cache=static"):
        to_job(composed("model=hf", f"model.checkpoint={whisper_checkpoint}"))
    with pytest.raises(ConfigError, match=r"backend=webgpu: .* a speech recognizer"):
        to_job(composed(*encoded_job(whisper_checkpoint, "backend=webgpu")))
    with pytest.raises(ConfigError, match=r"quantize=int4_weight: .* float only"):
        to_job(composed(*encoded_job(whisper_checkpoint, "backend=aoti", "quantize=int4_weight")))
