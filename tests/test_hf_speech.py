"""exporter/models/hf_speech.py (issue 43, WIP): Whisper as `encode` plus a decoder with a static
cache computes transformers' logits, in a prefill and in decode steps, and both methods export."""

from __future__ import annotations

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from exporter.models.hf_speech import WhisperCacheLM

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
    encode = torch.export.export(whisper.encoder_view(), (features,), strict=True)
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
