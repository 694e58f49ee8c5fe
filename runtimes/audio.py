"""Speech in for `transcribe` (issue 43), on the target without transformers: a WAV file read
as 16 kHz mono samples, and Whisper's log-mel spectrogram of them (the encoder's
`input_features`, [n_mels, 3000] for 30 s).

Whisper's front end, as its paper and reference code define it: the audio padded or cut to 30 s
(480,000 samples); a short-time Fourier transform with a periodic Hann window of 400 samples,
hop 160, the signal reflected at both ends; the power spectrum's last frame dropped; a mel
filter bank of Slaney's scale with Slaney's area normalisation; log10 of the power clamped at
1e-10; everything below the loudest value minus 8 raised to it; then (x + 4) / 4.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
CHUNK_SECONDS = 30
N_FFT = 400
HOP = 160
CHUNK_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS
FRAMES = CHUNK_SAMPLES // HOP


class AudioRefused(ValueError):
    """A file `transcribe` cannot read as speech: one line naming the file and why."""


def read_wav(path: Path) -> np.ndarray:
    """The file's samples as float32 in [-1, 1], mono (channels averaged), at 16 kHz. Other
    rates are refused rather than resampled: a resampler's choices change the features."""
    try:
        with wave.open(str(path), "rb") as audio:
            channels, width, rate = audio.getnchannels(), audio.getsampwidth(), audio.getframerate()
            frames = audio.readframes(audio.getnframes())
    except (wave.Error, EOFError) as error:
        raise AudioRefused(f"{path}: not a PCM WAV file ({error})") from error
    if rate != SAMPLE_RATE:
        raise AudioRefused(f"{path}: {rate} Hz; transcribe takes {SAMPLE_RATE} Hz audio")
    kinds = {1: np.uint8, 2: np.int16, 4: np.int32}
    if width not in kinds:
        raise AudioRefused(f"{path}: {8 * width}-bit samples; transcribe takes 8, 16 or 32")
    samples = np.frombuffer(frames, kinds[width]).astype(np.float32)
    if width == 1:
        samples = (samples - 128) / 128
    else:
        samples /= float(2 ** (8 * width - 1))
    return samples.reshape(-1, channels).mean(axis=1)


def log_mel(samples: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """Whisper's input features [n_mels, 3000] of one 30 s chunk (the module docstring)."""
    chunk = np.zeros(CHUNK_SAMPLES, np.float64)
    kept = samples[:CHUNK_SAMPLES].astype(np.float64)
    chunk[: kept.size] = kept
    padded = np.pad(chunk, N_FFT // 2, mode="reflect")
    starts = np.arange(FRAMES + 1) * HOP
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)
    frames = padded[starts[:, None] + np.arange(N_FFT)] * window
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    mel = mel_filters(n_mels) @ power[:-1].T
    logged = np.log10(np.maximum(mel, 1e-10))
    logged = np.maximum(logged, logged.max() - 8.0)
    return ((logged + 4.0) / 4.0).astype(np.float32)


def mel_filters(n_mels: int) -> np.ndarray:
    """Triangular filters [n_mels, N_FFT // 2 + 1] evenly spaced on Slaney's mel scale from 0 Hz
    to the Nyquist frequency, each scaled to unit area (2 / its width in Hz)."""
    bins = np.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    edges = _hz(np.linspace(_mel(0.0), _mel(SAMPLE_RATE / 2), n_mels + 2))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins - lower) / (centre - lower)
    falling = (upper - bins) / (upper - centre)
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    return triangles * (2.0 / (upper - lower))


# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels for
# each factor of 6.4).
_LINEAR_HZ = 200.0 / 3
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _LINEAR_HZ
_LOG_STEP = np.log(6.4) / 27.0


def _mel(hz: np.ndarray | float) -> np.ndarray:
    hz = np.asarray(hz, np.float64)
    linear = hz / _LINEAR_HZ
    logarithmic = _BREAK_MEL + np.log(np.maximum(hz, _BREAK_HZ) / _BREAK_HZ) / _LOG_STEP
    return np.where(hz >= _BREAK_HZ, logarithmic, linear)


def _hz(mel: np.ndarray) -> np.ndarray:
    linear = mel * _LINEAR_HZ
    logarithmic = _BREAK_HZ * np.exp(_LOG_STEP * (mel - _BREAK_MEL))
    return np.where(mel >= _BREAK_MEL, logarithmic, linear)
