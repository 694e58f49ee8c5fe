"""SmolVLM (exporter/models/hf_vision_lm.py): `encode` plus a decoder with a static cache computes
transformers' logits whether an image's tokens come in one prefill or one call each, both
methods export, and a SmolVLM checkpoint's job judges every decode step of sessions that each
hold an image of their own, through eager, ExecuTorch and AOTInductor, where an encode method
whose features the decoder never reads fails every step that comes after the image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.export.pt2_archive._package import load_pt2
from transformers import (
    PreTrainedTokenizerFast,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessor,
)

from exporter.config import to_job
from exporter.errors import ConfigError
from exporter.models.bundle import encode_as_forward
from exporter.models.hf_vision_lm import VisionLanguageCacheLM, blobs, declare_vision_lm
from runtimes import pixels, run
from tests.conftest import composed, job_in_process
from tests.test_hf_speech import encode_apart, encoded_job

IMAGE_TOKEN = 299
SMALL = SmolVLMConfig(
    text_config={
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # 32 x 32 pixels in patches of 8: 16 patches, 4 image tokens after the pixel shuffle.
    vision_config={
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    },
    scale_factor=2,
    image_token_id=IMAGE_TOKEN,
)
ROWS = 4


def _model() -> SmolVLMForConditionalGeneration:
    torch.manual_seed(0)
    return SmolVLMForConditionalGeneration(SMALL).eval()


def test_image_tokens_read_the_images_features_in_a_prefill_or_a_call_each() -> None:
    model = _model()
    vlm = VisionLanguageCacheLM(model, slots=16).eval()
    image = blobs(3, 32, 3)
    tokens = torch.tensor([[5, *[IMAGE_TOKEN] * ROWS, 7, 8, 9, 10]])
    with torch.no_grad():
        expected = model(input_ids=tokens, pixel_values=image.unsqueeze(1)).logits
        features = vlm.encode(image)
        assert torch.equal(
            features, model.model.get_image_features(image.unsqueeze(1)).pooler_output[0]
        )
        # The image split across a prefill and decode steps: its rows are read in order.
        calls = [vlm(tokens[:, :3], torch.arange(3))]
        calls += [vlm(tokens[:, p : p + 1], torch.tensor([p])) for p in range(3, tokens.shape[1])]
        torch.testing.assert_close(torch.cat(calls, dim=1), expected, atol=1e-5, rtol=0)
        # Encoding the image again starts its rows over: the same prompt in one prefill.
        vlm.encode(image)
        whole = vlm(tokens, torch.arange(tokens.shape[1]))
        torch.testing.assert_close(whole, expected, atol=1e-5, rtol=0)
        # Another image changes what the tokens after it see.
        vlm.encode(blobs(4, 32, 3))
        other = vlm(tokens, torch.arange(tokens.shape[1]))
    assert (other[0, ROWS + 1 :] - expected[0, ROWS + 1 :]).abs().max() > 1e-3
    assert torch.equal(other[0, 0], whole[0, 0])


def test_both_methods_export_and_the_decoder_reads_what_encode_wrote() -> None:
    vlm = VisionLanguageCacheLM(_model(), slots=16).eval()
    image = blobs(0, 32, 3)
    tokens = torch.tensor([[5, *[IMAGE_TOKEN] * ROWS]])
    seq = torch.export.Dim("seq", min=1, max=16)
    encode = torch.export.export(encode_as_forward(vlm), (image,), strict=True)
    decode = torch.export.export(
        vlm, (tokens, torch.arange(5)), dynamic_shapes=({1: seq}, {0: seq}), strict=True
    )
    with torch.no_grad():
        vlm.encode(image)
        expected = vlm(tokens, torch.arange(5))
        # Its own state, not the rotary embedding's frequencies, which the programs hold too.
        for buffer in vlm.buffers(recurse=False):
            buffer.zero_()
        encode.module()(image)
        actual = decode.module()(tokens, torch.arange(5))
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)
    assert set(encode.constants) <= set(decode.constants)


def _processor() -> SmolVLMImageProcessor:
    """SmolVLM's image processor at the tiny model's size, one image without tiles."""
    return SmolVLMImageProcessor(
        do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
    )


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("smolvlm")
    _model().save_pretrained(directory)
    _processor().save_pretrained(directory)
    # A word per id, so that the text describe prints reads as the ids the model chose.
    vocab = {f"w{index}": index for index in range(SMALL.text_config.vocab_size)}
    vocab["<eos>"] = vocab.pop("w2")
    words = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def eager_job(vlm_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    run_dir = tmp_path_factory.mktemp("smolvlm-eager")
    return run_dir, *job_in_process(run_dir, *encoded_job(vlm_checkpoint, "backend=eager"))


def _image_file(folder: Path, seed: int, height: int, width: int) -> Path:
    """A PNG of seeded blobs, `height` x `width` pixels."""
    side = max(height, width)
    values = ((blobs(seed, side, 3)[0] + 1) / 2 * 255).round().byte().permute(1, 2, 0)
    path = folder / f"image{seed}.png"
    Image.fromarray(values[:height, :width].numpy()).save(path)
    return path


@pytest.fixture(scope="module")
def aoti_job(vlm_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    run_dir = tmp_path_factory.mktemp("smolvlm-aoti")
    return run_dir, *job_in_process(run_dir, *encoded_job(vlm_checkpoint, "backend=aoti"))


def _assert_every_step_passed(report: dict) -> None:
    steps = [e["shape"] for e in report["executions"]]
    assert {s["session"] for s in steps if s["pos"] == 15} == {0, 1, 2}
    assert len(steps) == 26 and all(e["passed"] for e in report["executions"])
    assert max(o["ratio"] for e in report["executions"] for o in e["outputs"]) < 5
    greedy = report["greedy"]
    # From the first token and the image's, to the last slot.
    assert greedy["prompt"] == [1, *[IMAGE_TOKEN] * ROWS] and len(greedy["oracle"]) == 11
    assert greedy["artifact"] == greedy["eager"] == greedy["oracle"]


def test_a_smolvlm_checkpoint_is_judged_at_every_step_of_sessions_each_with_an_image(
    eager_job: tuple,
) -> None:
    tmp_path, record, report = eager_job
    assert record.error is None
    _assert_every_step_passed(report)
    goldens = torch.load(tmp_path / "bundle" / "goldens.pt", weights_only=True)
    for session in goldens["sessions"]:
        # Each session holds its image's tokens once, after its first token.
        tokens = session["tokens"]
        assert torch.equal(tokens[1 : 1 + ROWS], torch.full((ROWS,), IMAGE_TOKEN))
        assert int((tokens == IMAGE_TOKEN).sum()) == ROWS
        assert tuple(session["encoded"].shape) == (1, 3, 32, 32)
    images = [session["encoded"] for session in goldens["sessions"]]
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])
    # The encode program holds the vision tower and the connector, the model's the rest.
    programs = load_pt2(tmp_path / "program.pt2").exported_programs
    model, encode = set(programs["model"].state_dict), set(programs["encode"].state_dict)
    assert not model & encode
    assert all("vision_model" in name or "connector" in name for name in encode)
    # Every weight, and the rotary embedding's frequencies the model's program holds too.
    audit = report["weights_audit"]
    assert audit["checked"] == len(model | encode) + 1 and "rotary_emb.inv_freq" in str(audit)
    assert not audit["mismatched"] and not audit["unseen"]


@pytest.mark.slow
def test_smolvlm_through_executorch_passes_with_two_methods(
    vlm_checkpoint: Path, tmp_path: Path
) -> None:
    record, report = job_in_process(tmp_path, *encoded_job(vlm_checkpoint, "backend=executorch"))
    assert record.error is None
    _assert_every_step_passed(report)
    program = Runtime.get().load_program(tmp_path / "model.pte")
    assert program.method_names >= {"forward", "encode"}


@pytest.mark.slow
def test_smolvlm_through_aoti_passes(aoti_job: tuple) -> None:
    _, record, report = aoti_job
    assert record.error is None
    _assert_every_step_passed(report)


@pytest.mark.slow
def test_an_encode_method_whose_features_are_never_read_fails_every_step_after_the_image(
    vlm_checkpoint: Path, aoti_job: tuple, tmp_path: Path
) -> None:
    # An encode method loaded apart writes features of its own; the decoder reads zeros for
    # the image. Only a call that ends before the image (session 0's one-token prefill) passes.
    faulty = encode_apart(aoti_job[0] / "program.pt2", tmp_path / "model.pt2")
    record, report = job_in_process(
        tmp_path / "run", *encoded_job(vlm_checkpoint, "backend=aoti", f"artifact={faulty}")
    )
    assert record.error is not None
    passed = [
        (e["shape"]["session"], e["shape"]["pos"]) for e in report["executions"] if e["passed"]
    ]
    assert passed == [(0, 0)] and len(report["executions"]) == 26


def test_a_smolvlm_checkpoint_needs_a_static_cache_and_a_backend_with_two_methods(
    vlm_checkpoint: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"vision-language model .*add model\.kv_cache=static"):
        to_job(composed("model=hf", f"model.checkpoint={vlm_checkpoint}"))
    with pytest.raises(ConfigError, match=r"backend=webgpu: .* a vision-language model"):
        to_job(composed(*encoded_job(vlm_checkpoint, "backend=webgpu")))
    with pytest.raises(ConfigError, match=r"quantize=int4_weight: .* float only"):
        to_job(composed(*encoded_job(vlm_checkpoint, "backend=aoti", "quantize=int4_weight")))
    # An image of 4 tokens, a token before it and one after: 6 slots at least.
    with pytest.raises(ConfigError, match=r"an image is 4 tokens: the cache needs at least 6"):
        declare_vision_lm(_model(), Path(), 5)


@pytest.mark.parametrize(("height", "width"), [(48, 48), (64, 40), (20, 30)])
def test_the_targets_pixels_are_smolvlms_processors(
    tmp_path: Path, height: int, width: int
) -> None:
    _processor().save_pretrained(tmp_path)
    image = _image_file(tmp_path, 7, height, width)
    expected = _processor()(images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
    actual = pixels.read(tmp_path).pixel_values(image, 32, 32)
    torch.testing.assert_close(actual, expected["pixel_values"][0], atol=1e-6, rtol=0)


def test_describe_prints_the_text_of_eagers_greedy_tokens_after_an_image_and_a_prompt(
    eager_job: tuple, vlm_checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    bundle = str(eager_job[0] / "bundle")
    image = _image_file(tmp_path, 11, 40, 56)
    assert run.main([bundle, "describe", str(image), "--prompt", "w5 w6"]) == 0
    printed = capfd.readouterr().out.splitlines()
    model = SmolVLMForConditionalGeneration.from_pretrained(vlm_checkpoint).eval()
    vlm = VisionLanguageCacheLM(model, slots=16).eval()
    processed = _processor()(images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
    tokens, position = [1, *[IMAGE_TOKEN] * ROWS, 5, 6], 0
    with torch.no_grad():
        vlm.encode(processed["pixel_values"][0])
        while len(tokens) < 16:
            logits = vlm(torch.tensor([tokens[position:]]), torch.arange(position, len(tokens)))
            position = len(tokens)
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == 2:
                break
    expected = " ".join(f"w{token}" for token in tokens[7:] if token != 2)
    assert expected and printed[1] == expected
    assert printed[2].startswith("[describe] encode ")
    # What describe cannot take: a file that is no image, a prompt past one prefill, and a
    # bundle of a model without an image encoder (transcribe's is Whisper's).
    assert run.main([bundle, "describe", str(vlm_checkpoint / "config.json")]) == 2
    assert run.main([bundle, "describe", str(image), "--prompt", "w5 w6 w7 w8"]) == 2
    assert run.main([bundle, "transcribe", str(image)]) == 2
    # The last three lines: loading the model above printed its progress there before them.
    errors = capfd.readouterr().err.splitlines()[-3:]
    assert "config.json: not an image Pillow reads" in errors[0]
    assert "9 tokens, and the artifact's prefill takes at most 8" in errors[1]
    assert "without an encode method that reads audio" in errors[2]
