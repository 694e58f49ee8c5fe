"""`python -m runtimes.run BUNDLE TASK ...`: run what a job exported, on a target that has its
bundle (runtimes/formats/bundle.py), torch, the artifact's runtime package and this package; a
subcommand per task.

`generate`: a causal LM exported with a static KV cache (`model.kv_cache=static`) continues a
prompt on one loaded instance (runtimes/generation.py). The prompt is text (`--prompt`, encoded
with the bundle's tokenizer, which transformers reads; `--chat` puts it in the tokenizer's chat
template) or token ids (`--ids`); the new tokens, greedy or sampled (`--temperature`, `--top-k`,
`--seed`), are printed as they come, as text for a prompt given as text and as ids for ids, up
to `--max-new-tokens` or the model's EOS ids (the manifest's runner metadata); then one line of
figures: the prompt's tokens, the tokens generated, the prefill's milliseconds and the decode
steps' median milliseconds per token.

`classify`: an image classifier exported from a checkpoint with its image processor labels image
files (runtimes/classification.py): each file read and preprocessed by the bundle's image
processor, the images run in batches of at most the artifact's largest batch, and each image's
most likely labels printed with their probabilities; then one line of figures.

`transcribe`: a speech recognizer (Whisper) transcribes a 16 kHz WAV file (its first 30 s): the
samples turned into the encoder's log-mel features (runtimes/audio.py), the artifact's encode
method run on them, then greedy decoding from the model's prompt (the manifest's runner
metadata) to its end of text or `--max-new-tokens`; the text, decoded by the bundle's tokenizer
(the tokens' ids where it has none), then one line of figures.

`describe`: a vision-language model (SmolVLM) continues an image file and `--prompt`: the image
resized and normalized as the bundle's image processor settings say (runtimes/pixels.py), the
artifact's encode method run on it, then greedy decoding from the model's prompt (its first token
and the image's tokens) and the prompt's tokens, printed as `transcribe` prints.

What native libraries print (ExecuTorch's C++ log lines) goes to native.log in the bundle, where
it can be written. It imports nothing of the exporter.

Exit codes: 0 generated, classified, transcribed or described, 2 bad input (a bundle missing,
incomplete or of another model than the task runs, an argument, image or audio file it cannot
take: the line names it), 5 the artifact cannot be loaded or run, 130 stopped by Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtimes import Loaded, audio, classification, load, native_log, pixels, tokenizer
from runtimes.formats.bundle import Bundle, BundleInvalid, read
from runtimes.generation import Sampling, generate
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.sessions import Cache

if TYPE_CHECKING:
    import torch

# torchao, which transformers imports where it is installed, trips a deprecation notice in
# torch's pytree registry at import time; it says nothing about the run (as exporter/__init__.py).
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

DONE, BAD_INPUT, RUNTIME_FAILED, STOPPED = 0, 2, 5, 130
# New tokens where --max-new-tokens is not given, fewer where the cache has less room.
DEFAULT_NEW_TOKENS = 32


class BadInput(Exception):
    """An argument or file the task cannot take; the message names it."""


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.task(args)
    except BadInput as error:
        print(f"[{args.task_name}] {error}", file=sys.stderr)
        return BAD_INPUT


def _generate(args: argparse.Namespace) -> int:
    bundle = _bundle(Path(args.bundle))
    metadata = bundle.runner_metadata
    slots = metadata["get_max_context_len"]
    sampling = _sampling(args)
    prompt, stream = _prompt(args, bundle)
    count = _new_tokens(args.max_new_tokens, len(prompt), slots)
    device = args.device or bundle.device
    print(
        f"[generate] {bundle.artifact} on {bundle.runtime} ({device}), a cache of {slots} slots: "
        f"{len(prompt)} prompt tokens, up to {count} new, {sampling.describe()}",
        flush=True,
    )
    try:
        with _loaded(bundle, device) as loaded:
            eos_ids = set(metadata.get("get_eos_ids", ()))
            generated = generate(
                Cache(loaded, slots), prompt, count, eos_ids, sampling, _printer(stream)
            )
    except KeyboardInterrupt:
        print(flush=True)
        print("[generate] stopped by Ctrl-C", file=sys.stderr)
        return STOPPED
    except _LoadFailed as error:
        print(f"[generate] {error}", file=sys.stderr)
        return RUNTIME_FAILED
    except ArtifactFailed as error:
        # After the tokens printed so far, on a line of its own.
        print(flush=True)
        print(f"[generate] {error}", file=sys.stderr)
        return RUNTIME_FAILED
    print(stream.rest() if stream is not None else "", flush=True)
    print(f"[generate] {generated.figures(sampling)}")
    return DONE


class _LoadFailed(Exception):
    """The artifact's runtime could not load it on the device."""


@contextlib.contextmanager
def _loaded(bundle: Bundle, device: str) -> Iterator[Loaded]:
    """The bundle's artifact loaded on `device` (_LoadFailed where its runtime cannot), what
    native libraries print meanwhile going to native.log in the bundle where it can be
    written."""
    native = bundle.folder / native_log.NATIVE_LOG
    writable = os.access(bundle.folder, os.W_OK)
    with native_log.routed_to(native) if writable else contextlib.nullcontext():
        try:
            loaded = load(bundle.artifact_path, bundle.runtime, device)
        except Exception as error:
            raise _LoadFailed(bundle.load_failure(device, error)) from error
        yield loaded


def _classify(args: argparse.Namespace) -> int:
    bundle = _read(Path(args.bundle))
    if bundle.preprocessor is None:
        raise BadInput(
            f"{bundle.folder}: a bundle of {_model(bundle)} without an image processor; classify "
            "runs an image classifier exported from a checkpoint saved with its image processor "
            "(preprocessor_config.json: the processor's save_pretrained)"
        )
    if args.top < 1:
        raise BadInput(f"--top {args.top}: at least 1")
    try:
        preprocessor = classification.read(bundle.folder / bundle.preprocessor)
        pixels = preprocessor.pixel_values([Path(image) for image in args.images])
    except classification.ImageRefused as error:
        raise BadInput(str(error)) from error
    batches = _batches(pixels, bundle)
    device = args.device or bundle.device
    print(
        f"[classify] {bundle.artifact} on {bundle.runtime} ({device}): {len(args.images)} "
        f"images of {pixels.shape[2]}x{pixels.shape[3]}, {len(batches)} batch"
        f"{'es' if len(batches) > 1 else ''}",
        flush=True,
    )
    results = []
    try:
        with _loaded(bundle, device) as loaded:
            for batch in batches:
                results.append(classification.classify(loaded, preprocessor, batch, args.top))
    except _LoadFailed as error:
        print(f"[classify] {error}", file=sys.stderr)
        return RUNTIME_FAILED
    except ArtifactFailed as error:
        print(f"[classify] {error}", file=sys.stderr)
        return RUNTIME_FAILED
    ranked = [labels for result in results for labels in result.ranked]
    for image, labels in zip(args.images, ranked, strict=True):
        print(f"{image}: " + ", ".join(f"{name} {p:.3f}" for name, p in labels))
    total_ms = sum(result.batch_ms for result in results)
    calls = f"{len(results)} call{'s' if len(results) > 1 else ''}"
    print(f"[classify] {len(ranked)} images in {calls}, {total_ms:.1f} ms")
    return DONE


def _transcribe(args: argparse.Namespace) -> int:
    bundle = _bundle(Path(args.bundle))
    metadata = bundle.runner_metadata
    shape = metadata.get("get_encoder_input_shape")
    if shape is None or len(shape) != 3:
        raise BadInput(
            f"{bundle.folder}: a bundle of {_model(bundle)} without an encode method that reads "
            "audio; transcribe runs a speech recognizer (Whisper) exported with model=hf"
        )
    try:
        samples = audio.read_wav(Path(args.audio))
    except (audio.AudioRefused, OSError) as error:
        raise BadInput(str(error)) from error
    import torch

    features = torch.from_numpy(audio.log_mel(samples, shape[1])).unsqueeze(0)
    seconds = min(len(samples) / audio.SAMPLE_RATE, audio.CHUNK_SECONDS)
    prompt = list(metadata["get_decoder_prompt_ids"])
    return _decoded_after_encoding(
        args, bundle, features, prompt, _text_tokenizer(bundle), f"{seconds:.1f} s of {args.audio}"
    )


def _describe(args: argparse.Namespace) -> int:
    bundle = _bundle(Path(args.bundle))
    metadata = bundle.runner_metadata
    shape = metadata.get("get_encoder_input_shape")
    if shape is None or len(shape) != 4:
        raise BadInput(
            f"{bundle.folder}: a bundle of {_model(bundle)} without an encode method that reads "
            "an image; describe runs a vision-language model (SmolVLM) exported with model=hf"
        )
    if bundle.preprocessor is None:
        raise BadInput(
            f"{bundle.folder}: the bundle has no image processor settings (the checkpoint was "
            "saved without its preprocessor_config.json), which describe normalizes the image with"
        )
    try:
        settings = pixels.read(bundle.folder / bundle.preprocessor)
        values = settings.pixel_values(Path(args.image), shape[2], shape[3])
    except classification.ImageRefused as error:
        raise BadInput(str(error)) from error
    read_tokenizer = _text_tokenizer(bundle)
    prompt = list(metadata["get_decoder_prompt_ids"])
    if args.prompt is not None:
        if read_tokenizer is None:
            raise BadInput(
                f"--prompt: the bundle has no tokenizer ({_model(bundle)} was exported without one)"
            )
        # After the image: the text's own tokens, without the BOS that starts a sequence.
        prompt += list(read_tokenizer.encode(args.prompt, add_special_tokens=False))
    _check_fits("the image's tokens and --prompt", prompt, metadata)
    return _decoded_after_encoding(args, bundle, values, prompt, read_tokenizer, str(args.image))


def _text_tokenizer(bundle: Bundle) -> Any:
    """The bundle's tokenizer, read before the model runs (one this target cannot read is
    refused in a line, not after the decoding); None where the bundle has none."""
    if bundle.tokenizer is None:
        return None
    try:
        return tokenizer.read(bundle.folder / bundle.tokenizer)
    except tokenizer.TokenizerRefused as error:
        raise BadInput(str(error)) from error


def _decoded_after_encoding(
    args: argparse.Namespace,
    bundle: Bundle,
    encoded: torch.Tensor,
    prompt: list[int],
    read_tokenizer: Any,
    what: str,
) -> int:
    """The artifact's encode method run on `encoded`, then greedy decoding from `prompt` to an
    EOS id or --max-new-tokens: the text (the ids where the bundle has no tokenizer), then the
    encode's time and the decoding's figures."""
    task = args.task_name
    metadata = bundle.runner_metadata
    slots = metadata["get_max_context_len"]
    count = _new_tokens(args.max_new_tokens, len(prompt), slots)
    device = args.device or bundle.device
    print(
        f"[{task}] {bundle.artifact} on {bundle.runtime} ({device}): {what}, up to {count} tokens",
        flush=True,
    )
    try:
        with _loaded(bundle, device) as loaded:
            started = time.perf_counter()
            try:
                loaded.encode((encoded,))
            except Exception as error:
                raise ArtifactFailed(
                    f"the encode method failed: {type(error).__name__}: {error}"
                ) from error
            encode_ms = (time.perf_counter() - started) * 1e3
            eos_ids = set(metadata.get("get_eos_ids", ()))
            generated = generate(Cache(loaded, slots), prompt, count, eos_ids, Sampling())
    except (_LoadFailed, ArtifactFailed) as error:
        print(f"[{task}] {error}", file=sys.stderr)
        return RUNTIME_FAILED
    text = [t for t in generated.tokens if t not in eos_ids]
    if read_tokenizer is not None:
        print(read_tokenizer.decode(text, skip_special_tokens=True).strip())
    else:
        print(",".join(map(str, text)))
    print(f"[{task}] encode {encode_ms:.1f} ms, {generated.figures(Sampling())}")
    return DONE


def _read(folder: Path) -> Bundle:
    """The bundle, every file checked against its manifest."""
    try:
        return read(folder)
    except BundleInvalid as error:
        raise BadInput(f"the bundle cannot be read: {error}") from error


def _batches(pixels: torch.Tensor, bundle: Bundle) -> list[torch.Tensor]:
    """The images in batches the artifact takes: at most its largest batch each. Refused where
    the image processor makes images of a size outside the artifact's bounds (a dynamic size:
    its live shapes' least and largest; a fixed one: its load or run says)."""
    for dim, axis in (("height", 2), ("width", 3)):
        sizes = [shape[dim] for shape in bundle.shapes if dim in shape]
        if sizes and not min(sizes) <= pixels.shape[axis] <= max(sizes):
            raise BadInput(
                f"the bundle's image processor makes images of {dim} {pixels.shape[axis]}, and "
                f"the artifact takes {min(sizes)}..{max(sizes)}: export with dynamic.{dim} "
                "bounds that hold it, or save the checkpoint with a processor of that size"
            )
    largest = max((shape.get("batch", 1) for shape in bundle.shapes), default=1)
    return list(pixels.split(largest))


def _bundle(folder: Path) -> Bundle:
    """The bundle, every file checked against its manifest, of a causal LM with a KV cache."""
    bundle = _read(folder)
    if bundle.runner_metadata.get("use_kv_cache"):
        return bundle
    if bundle.sessions:
        raise BadInput(
            f"{folder}: the bundle's manifest has sessions but no runner metadata (the cache's "
            "slots, the vocabulary, the EOS ids): an exporter older than `runtimes.run` wrote "
            "it; export the model again"
        )
    raise BadInput(
        f"{folder}: a bundle of {_model(bundle)} without a KV cache; generate continues a "
        "causal LM exported with one: export it with model.kv_cache=static"
    )


def _model(bundle: Bundle) -> str:
    """The job's model as its override names it: `model=llama`."""
    return f"model={bundle.source.get('model', '?')}"


def _sampling(args: argparse.Namespace) -> Sampling:
    if args.temperature is None or args.temperature == 0:
        if args.top_k is not None or args.seed is not None:
            raise BadInput(
                "--top-k and --seed choose among sampled tokens: give --temperature above 0 "
                "too (without it, generation is greedy: the most likely token)"
            )
        return Sampling()
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise BadInput(
            f"--temperature {args.temperature}: a finite number, 0 or above (0 is greedy)"
        )
    if args.top_k is not None and args.top_k < 1:
        raise BadInput(f"--top-k {args.top_k}: at least 1")
    # Drawn where not given, and said with the figures: the run can be repeated with it.
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    return Sampling(args.temperature, args.top_k, seed)


def _prompt(
    args: argparse.Namespace, bundle: Bundle
) -> tuple[list[int], tokenizer.TextStream | None]:
    """The prompt's token ids, which one prefill takes with a cache slot left to generate in;
    for a prompt given as text, what turns the new tokens into text (None: they are printed as
    ids)."""
    metadata = bundle.runner_metadata
    if args.prompt is not None:
        read_tokenizer = _tokenizer(bundle)
        try:
            ids = tokenizer.prompt_ids(read_tokenizer, args.prompt, args.chat)
        except tokenizer.TokenizerRefused as error:
            raise BadInput(f"--chat: {error}") from error
        stream = tokenizer.TextStream(read_tokenizer)
    elif args.chat:
        raise BadInput(
            "--chat puts --prompt in the tokenizer's chat template; --ids are sent as given"
        )
    else:
        ids = _ids(args.ids, metadata["get_vocab_size"])
        stream = None
    source = "--prompt" if args.prompt is not None else "--ids"
    if not ids:
        raise BadInput(f"{source}: no tokens to start from")
    _check_fits(source, ids, metadata)
    return ids, stream


def _check_fits(source: str, ids: list[int], metadata: dict) -> None:
    """Refuses a prompt that one prefill cannot take, or that leaves no cache slot to generate
    in."""
    slots, longest = metadata["get_max_context_len"], metadata["get_max_seq_len"]
    if len(ids) > longest:
        raise BadInput(
            f"{source}: {len(ids)} tokens, and the artifact's prefill takes at most {longest} "
            "(its dynamic.seq.max): shorten the prompt, or export with a larger dynamic.seq.max"
        )
    if len(ids) >= slots:
        raise BadInput(
            f"{source}: {len(ids)} tokens fill the cache's {slots} slots, leaving none to "
            "generate in: shorten the prompt, or export with a larger model.max_cache_len"
        )


def _tokenizer(bundle: Bundle) -> Any:
    read_tokenizer = _text_tokenizer(bundle)
    if read_tokenizer is None:
        raise BadInput(
            f"--prompt: the bundle has no tokenizer ({_model(bundle)} was exported without one): "
            "give the prompt's token ids with --ids 1,2,3"
        )
    return read_tokenizer


def _ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError as error:
        raise BadInput(f"--ids {text}: not token ids separated by commas (1,2,3)") from error
    outside = [token for token in ids if not 0 <= token < vocab_size]
    if outside:
        raise BadInput(
            f"--ids: {', '.join(map(str, outside))} outside the vocabulary's ids "
            f"0..{vocab_size - 1}"
        )
    return ids


def _new_tokens(asked: int | None, prompt: int, slots: int) -> int:
    """The tokens to generate: as many as asked, where the prompt leaves them cache slots."""
    room = slots - prompt
    if asked is None:
        return min(DEFAULT_NEW_TOKENS, room)
    if asked < 1:
        raise BadInput(f"--max-new-tokens {asked}: at least 1")
    if asked > room:
        raise BadInput(
            f"--max-new-tokens {asked}: the cache has {slots} slots and the prompt takes "
            f"{prompt}, leaving {room}: ask for at most {room}, or export with a larger "
            "model.max_cache_len"
        )
    return asked


def _printer(stream: tokenizer.TextStream | None) -> Callable[[int], None]:
    """What prints each new token as it comes: its text, or its id, commas between ids."""
    separator = ""

    def print_token(token: int) -> None:
        nonlocal separator
        if stream is not None:
            print(stream.piece(token), end="", flush=True)
        else:
            print(f"{separator}{token}", end="", flush=True)
            separator = ","

    return print_token


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtimes.run",
        description="Run an exported model from its bundle on this machine.",
    )
    parser.add_argument("bundle", help="the bundle folder (a job's run dir has it as bundle/)")
    tasks = parser.add_subparsers(title="tasks", required=True, metavar="TASK")
    # What every task takes.
    on_device = argparse.ArgumentParser(add_help=False)
    on_device.add_argument(
        "--device",
        help="where the artifact runs (cpu, cuda, cuda:1; a wgpu adapter choice auto, gpu or "
        "cpu for webgpu); default: the job's",
    )
    # What every task that decodes takes.
    decoding = argparse.ArgumentParser(add_help=False)
    decoding.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"at most this many new tokens (default {DEFAULT_NEW_TOKENS}, or fewer where the "
        "cache has less room after the prompt)",
    )
    generate_parser = tasks.add_parser(
        "generate",
        parents=[on_device, decoding],
        help="continue a prompt with a causal LM exported with model.kv_cache=static",
        description="Continue a prompt with a causal LM exported with model.kv_cache=static, "
        "printing the new tokens as they come, then the prompt's and new tokens' counts, the "
        "prefill's time and the decode steps' median time per token.",
    )
    generate_parser.set_defaults(task=_generate, task_name="generate")
    prompt = generate_parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt as text, encoded with the bundle's tokenizer")
    prompt.add_argument("--ids", help="the prompt as token ids separated by commas: 1,2,3")
    generate_parser.add_argument(
        "--chat",
        action="store_true",
        help="put --prompt in the tokenizer's chat template, as a user's turn",
    )
    generate_parser.add_argument(
        "--temperature",
        type=float,
        help="sample at this temperature (default 0: greedy, the most likely token)",
    )
    generate_parser.add_argument(
        "--top-k", type=int, help="sample among the K most likely tokens only"
    )
    generate_parser.add_argument(
        "--seed", type=int, help="seed the sampling (default: drawn, and printed with the figures)"
    )
    classify_parser = tasks.add_parser(
        "classify",
        parents=[on_device],
        help="label images with an image classifier exported with its image processor",
        description="Label image files with an image classifier exported from a checkpoint "
        "saved with its image processor: each image's most likely labels and their "
        "probabilities, then the calls' count and time.",
    )
    classify_parser.set_defaults(task=_classify, task_name="classify")
    classify_parser.add_argument("images", nargs="+", help="image files Pillow reads")
    classify_parser.add_argument(
        "--top", type=int, default=5, help="the most likely labels printed per image (default 5)"
    )
    transcribe_parser = tasks.add_parser(
        "transcribe",
        parents=[on_device, decoding],
        help="transcribe a 16 kHz WAV file with a speech recognizer (Whisper)",
        description="Transcribe the first 30 s of a 16 kHz WAV file with a speech recognizer "
        "exported with model=hf (Whisper): its text, greedy, then the encode's time and the "
        "decoding's figures.",
    )
    transcribe_parser.set_defaults(task=_transcribe, task_name="transcribe")
    transcribe_parser.add_argument("audio", help="a 16 kHz PCM WAV file")
    describe_parser = tasks.add_parser(
        "describe",
        parents=[on_device, decoding],
        help="continue an image and a prompt with a vision-language model (SmolVLM)",
        description="Run a vision-language model exported with model=hf (SmolVLM) on an image "
        "file: the image's tokens, then --prompt's, continued greedily; the text, then the "
        "encode's time and the decoding's figures.",
    )
    describe_parser.set_defaults(task=_describe, task_name="describe")
    describe_parser.add_argument("image", help="an image file Pillow reads")
    describe_parser.add_argument(
        "--prompt", help="text after the image, encoded with the bundle's tokenizer"
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
