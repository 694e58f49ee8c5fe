"""runtimes/audio.py, `transcribe`'s front end: WAV files read as 16 kHz mono, and Whisper's
log-mel features computed without transformers, equal to transformers' WhisperFeatureExtractor
on audio shorter and longer than Whisper's 30 s chunk."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from runtimes import audio


def _tones(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(audio.SAMPLE_RATE * seconds)) / audio.SAMPLE_RATE
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (
        0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 3150 * t) + 0.05 * noise
    ).astype(np.float32)


@pytest.mark.parametrize(("seconds", "n_mels"), [(7.3, 80), (41.0, 80), (7.3, 128)])
def test_the_features_are_transformers_whisper_features(seconds: float, n_mels: int) -> None:
    samples = _tones(seconds, 0)
    expected = WhisperFeatureExtractor(feature_size=n_mels)(
        samples, sampling_rate=audio.SAMPLE_RATE, return_tensors="np"
    ).input_features[0]
    actual = audio.log_mel(samples, n_mels)
    assert actual.shape == expected.shape == (n_mels, audio.FRAMES)
    # Float64 here against transformers' float32 steps: the features span about 2.
    assert np.abs(actual - expected).max() < 1e-4


def _write(path: Path, samples: np.ndarray, rate: int, width: int, channels: int) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return path


def test_a_stereo_16_bit_wav_is_read_as_its_channels_mean(tmp_path: Path) -> None:
    left = np.array([16384, -16384, 0, 32767], np.int16)
    right = np.array([0, -16384, 16384, 32767], np.int16)
    path = _write(tmp_path / "a.wav", np.stack([left, right], 1), audio.SAMPLE_RATE, 2, 2)
    np.testing.assert_allclose(audio.read_wav(path), [0.25, -0.5, 0.25, 32767 / 32768])


def test_an_8_bit_wav_is_centred(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.wav", np.array([128, 0, 255], np.uint8), audio.SAMPLE_RATE, 1, 1)
    np.testing.assert_allclose(audio.read_wav(path), [0.0, -1.0, 127 / 128])


def test_another_rate_and_a_file_that_is_no_wav_are_refused_by_name(tmp_path: Path) -> None:
    cd = _write(tmp_path / "cd.wav", np.zeros(4, np.int16), 44_100, 2, 1)
    with pytest.raises(audio.AudioRefused, match=r"cd\.wav: 44100 Hz; transcribe takes 16000 Hz"):
        audio.read_wav(cd)
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    with pytest.raises(audio.AudioRefused, match=r"notes\.wav: not a PCM WAV file"):
        audio.read_wav(text)
