"""The goldens of a model with a KV cache: the plan of sessions, the float64 oracle's logits at
their judged steps, eager at the model's dtype running the same sessions with the same cache,
and a greedy generation by both (runtimes/verdict/sessions.py runs and judges the artifact),
from validate.prompt where it is set (a user's turn in the checkpoint's chat template, with the
tokenizer kept so the generations can be read as text). A quantized model's goldens add the float
model's float64 logits at the judged steps, eager's quality against them, the float model's
greedy tokens, and both models on the quality text (exporter/validate/text.py).

The oracle is the model without a cache (`Decoder.uncached`): one float64 call over a whole
session's tokens gives the logits of every position, since a causal LM's logits at a position
depend on the tokens up to it only. It shares no code with the cache.
"""

from __future__ import annotations

import logging
import random
import statistics
import zlib
from dataclasses import replace
from typing import Any

import torch

from exporter.errors import ConfigError, GoldensFailed
from exporter.models import Decoder, DynamicDim, ModelBundle
from exporter.quantize.verdict import Measuring
from exporter.validate import quantized_layers, text
from exporter.validate.goldens import moved_to, wider
from exporter.validate.oracle import float64_weights
from runtimes.verdict import sessions
from runtimes.verdict.compare import reference_error
from runtimes.verdict.goldens import Goldens, stored
from runtimes.verdict.shapes import label
from runtimes.verdict.stats import EagerError

log = logging.getLogger(__name__)

# The prompt of the greedy generation, at most: a chat turn's start.
_PROMPT_TOKENS = 8


def plan(decoder: Decoder, seq: DynamicDim, sampled: int, seed: int) -> list[dict]:
    """The sessions, in the order they run: prefills of seq's min (the longest decode), an odd
    length in the middle and its max, each then decoding one token at a time to the last cache
    slot. Each judges its first decode step, the last slot and `sampled` positions between,
    spread evenly with one seeded draw among them. A decoder that attends to an encoded input
    (Whisper's clip, SmolVLM's image) has one drawn per session (`encoded`), encoded as the
    session starts, and the tokens that stand for it in the sequence (Encoding.placeholders)
    after the session's first token."""
    rng = random.Random(seed)
    slots = decoder.max_cache_len
    middle = (seq.min + seq.max) // 2
    middle += 1 - middle % 2
    prefills = list(
        dict.fromkeys(min(max(p, seq.min), seq.max) for p in (seq.min, middle, seq.max))
    )
    planned = []
    for index, prefill in enumerate(prefills):
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:session{index}".encode()))
        tokens = torch.randint(0, decoder.vocab_size, (slots,), generator=generator)
        if decoder.encoding is not None and decoder.encoding.placeholders:
            tokens = _with_placeholders(tokens, decoder.encoding.placeholders, decoder.vocab_size)
        decode = range(prefill, slots)
        chosen: set[int] = set()
        if decode:
            chosen = {decode[0], decode[-1]}
            count = min(sampled, len(decode))
            chosen |= {decode[(i * (len(decode) - 1)) // max(count, 1)] for i in range(count)}
            chosen.add(rng.choice(decode))
        session = {"tokens": tokens, "prefill": prefill, "judged": sorted(chosen)}
        if decoder.encoding is not None:
            session["encoded"] = decoder.encoding.make_input(
                zlib.crc32(f"{seed}:clip{index}".encode())
            )
        planned.append(session)
    return planned


def _with_placeholders(
    tokens: torch.Tensor, placeholders: tuple[int, ...], vocab: int
) -> torch.Tensor:
    """`tokens` with `placeholders` after the first token, and each other token that is one of
    them drawn anew: the sequence holds the encoded input once, where the plan put it."""
    special = torch.tensor(sorted(set(placeholders)))
    drawn = tokens.clone()
    while bool(torch.isin(drawn, special).any()):
        clashing = torch.isin(drawn, special)
        drawn[clashing] = (drawn[clashing] + 1) % vocab
    drawn[1 : 1 + len(placeholders)] = torch.tensor(placeholders)
    return drawn


def compute(
    bundle: ModelBundle,
    planned: list[dict],
    greedy_tokens: int,
    reference_device: str,
    prompt_text: str | None = None,
    eval_text: str | None = None,
    seed: int = 0,
) -> Goldens:
    decoder = bundle.decoder
    assert decoder is not None
    slots = decoder.max_cache_len
    tokenizer = None
    if decoder.encoding is not None:
        # A transcription of the first session's clip.
        prompt = torch.tensor(decoder.encoding.prompt, dtype=torch.long)
    elif prompt_text is None:
        prompt = planned[0]["tokens"][: min(_PROMPT_TOKENS, slots - 1)]
    else:
        tokenizer = _tokenizer(decoder)
        (seq,) = bundle.dims
        prompt = _chat_prompt(tokenizer, prompt_text, seq.max, slots)
    oracle = [
        _oracle(decoder, session["tokens"], encoded=session.get("encoded")) for session in planned
    ]
    cases = {}
    for index, session in enumerate(planned):
        for shape in sessions.judged(index, session):
            start, count = shape["pos"], shape["seq"]
            expected = oracle[index][:, start : start + count]
            cases[label(shape)] = (sessions.step_inputs(session, shape), [expected])
    unquantized = _unquantized(bundle, planned)
    measuring = Measuring(unquantized, 0) if unquantized else None
    reference, dtype, eager_tokens = _reference(
        bundle.module, planned, cases, reference_device, prompt, greedy_tokens, measuring
    )
    if quantized_layers.has_dynamic_activations(decoder.uncached):
        reference = _with_rounding_band(decoder, planned, cases, reference)
    reference = _at_least_typical(reference, cases)
    greedy = None
    if greedy_tokens:
        greedy = {
            "prompt": prompt,
            "eager": eager_tokens,
            "oracle": _oracle_greedy(decoder, prompt, len(eager_tokens), planned[0].get("encoded")),
        }
        if "encoded" in planned[0]:
            greedy["encoded"] = planned[0]["encoded"]
        if tokenizer is not None:
            # The tokenizer as its JSON: the goldens hold plain data, and validation decodes
            # the artifact's tokens with it after the model is gone.
            greedy["prompt_text"] = prompt_text
            greedy["tokenizer"] = tokenizer.backend_tokenizer.to_str()
    kept = {
        key: (inputs, [stored(expected[0], dtype)]) for key, (inputs, expected) in cases.items()
    }
    found, on_text = {}, {}
    if measuring is not None:
        found = _quality(bundle, measuring, prompt, len(eager_tokens))
        on_text = text.goldens(bundle, eval_text, seed)
    return Goldens(
        kept,
        (dtype,),
        reference,
        reference_device,
        (True,),
        sessions=tuple(planned),
        greedy=greedy,
        unquantized=unquantized,
        quality=found,
        text=on_text,
    )


def _with_rounding_band(
    decoder: Decoder, planned: list[dict], cases: dict, reference: dict[str, list[EagerError]]
) -> dict[str, list[EagerError]]:
    """`reference` widened at every judged step to the oracle's own error with its activations'
    near ties rounded the other way (as exporter/validate/goldens.py does for calls)."""
    widened = dict(reference)
    largest = 0.0
    for index, session in enumerate(planned):
        flipped = _oracle(decoder, session["tokens"], ties_flipped=True)
        for shape in sessions.judged(index, session):
            start, count = shape["pos"], shape["seq"]
            expected = cases[label(shape)][1][0]
            band = reference_error(flipped[:, start : start + count], expected, True)
            largest = max(largest, band.max_abs)
            widened[label(shape)] = [wider(reference[label(shape)][0], band)]
    log.info(
        "[goldens] activations rounded to int8 as the model runs: near ties rounded the other "
        "way move the oracle's logits by up to %.3g (max abs); the reference rule scales the "
        "larger of that and eager's error",
        largest,
    )
    return widened


def _at_least_typical(
    reference: dict[str, list[EagerError]], cases: dict
) -> dict[str, list[EagerError]]:
    """`reference` widened at every one-token step to eager's typical error over all of them
    (the median, of max abs and RMS error each): eager's error at one step is one draw of what
    the model's precision costs (on Whisper tiny.en in float32, its RMS error over one job's
    steps spans a factor of 14), and a step where eager happened to round well would judge the
    artifact by that luck. Prefills of several tokens keep their own: calls of another shape."""
    one_token = [key for key, (inputs, _) in cases.items() if inputs[0].shape[-1] == 1]
    if not one_token:
        return reference
    # The high median: a value eager reached at one of the steps.
    typical_max_abs = statistics.median_high(reference[key][0].max_abs for key in one_token)
    typical_nrmse = statistics.median_high(reference[key][0].nrmse for key in one_token)
    widened = dict(reference)
    for key in one_token:
        own = reference[key][0]
        widened[key] = [
            replace(
                own,
                max_abs=max(own.max_abs, typical_max_abs),
                nrmse=max(own.nrmse, typical_nrmse),
            )
        ]
    return widened


def _unquantized(bundle: ModelBundle, planned: list[dict]) -> dict[str, torch.Tensor]:
    """A quantized model: the float model's float64 logits at every judged step, from its
    model without a cache; nothing for a float model."""
    if bundle.unquantized is None or bundle.unquantized.decoder is None:
        return {}
    float_decoder = bundle.unquantized.decoder
    logits = {}
    for index, session in enumerate(planned):
        whole = _oracle(float_decoder, session["tokens"])
        for shape in sessions.judged(index, session):
            start, count = shape["pos"], shape["seq"]
            logits[label(shape)] = whole[:, start : start + count]
    return logits


def _quality(
    bundle: ModelBundle, measuring: Measuring, prompt: torch.Tensor, greedy_count: int
) -> dict[str, Any]:
    """What the goldens measure of quality on the sessions: eager's against the float model at
    the judged steps, and the float model's greedy tokens (its float64 oracle's) after the
    prompt. The text's figures are exporter/validate/text.py's."""
    assert bundle.unquantized is not None and bundle.unquantized.decoder is not None
    return {
        "eager": measuring.to_json(),
        "greedy_float": _oracle_greedy(bundle.unquantized.decoder, prompt, greedy_count),
    }


def _oracle(
    decoder: Decoder,
    tokens: torch.Tensor,
    ties_flipped: bool = False,
    encoded: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits of every position of `tokens` in float64, from the model without a cache
    (after `encoded`, the session's clip, where the decoder attends to one); `ties_flipped`:
    its quantized activations' near ties rounded the other way."""
    extra = () if encoded is None else (encoded.to(torch.float64),)
    try:
        with torch.no_grad(), float64_weights(decoder.uncached, ties_flipped):
            return decoder.uncached(tokens.unsqueeze(0), *extra).to(torch.float64)
    except Exception as error:
        raise GoldensFailed(
            f"the float64 oracle (the model without its cache, in float64) could not run: "
            f"{type(error).__name__}: {error}."
        ) from error


def _oracle_greedy(
    decoder: Decoder, prompt: torch.Tensor, count: int, encoded: torch.Tensor | None = None
) -> list[int]:
    """Greedy tokens from the float64 oracle, each from the whole prefix recomputed."""
    tokens = prompt.tolist()
    generated = []
    for _ in range(count):
        logits = _oracle(decoder, torch.tensor(tokens), encoded=encoded)
        generated.append(int(logits[0, -1].argmax()))
        tokens.append(generated[-1])
    return generated


def _tokenizer(decoder: Decoder) -> Any:
    """The checkpoint's tokenizer (transformers')."""
    if decoder.tokenizer is None:
        raise ConfigError(
            "validate.prompt is encoded with the checkpoint's tokenizer, and this model has no "
            "checkpoint: use model=hf (or model=llama) with model.checkpoint."
        )
    return decoder.tokenizer()


def _chat_prompt(tokenizer: Any, text: str, longest: int, slots: int) -> torch.Tensor:
    """`text` as a user's turn in the tokenizer's chat template, the assistant's turn opened (as
    it is; a tokenizer without a template); one prefill of at most `longest` tokens, which
    leaves a cache slot to generate in."""
    if tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    else:
        ids = tokenizer.encode(text)
    if len(ids) > longest:
        raise ConfigError(
            f"validate.prompt is {len(ids)} tokens with the chat template, and a prefill takes "
            f"at most dynamic.seq.max={longest}: shorten the prompt or raise dynamic.seq.max."
        )
    if len(ids) >= slots:
        raise ConfigError(
            f"validate.prompt is {len(ids)} tokens with the chat template, and the cache has "
            f"{slots} slots (model.max_cache_len), none left to generate in: shorten the "
            f"prompt or raise model.max_cache_len."
        )
    return torch.tensor(ids, dtype=torch.long)


def _reference(
    module: torch.nn.Module,
    planned: list[dict],
    cases: dict,
    device: str,
    prompt: torch.Tensor,
    greedy_tokens: int,
    measuring: Measuring | None = None,
) -> tuple[dict[str, list[EagerError]], torch.dtype, list[int]]:
    """Eager at the model's dtype on `device`, its cache a buffer of the module, running the
    sessions as the artifact will: its error at every judged step (and its quality, where
    `measuring`), its logits' dtype, and its greedy tokens after `prompt`. The module returns to
    the CPU after, where export reads it."""
    reference: dict[str, list[EagerError]] = {}
    dtype = torch.float32
    slots = len(planned[0]["tokens"])

    try:
        with moved_to(module, device) as on_device:

            def call(tokens: torch.Tensor, start: int) -> torch.Tensor:
                positions = torch.arange(start, start + tokens.shape[-1], device=device)
                with torch.no_grad():
                    return on_device(tokens.to(device), positions).cpu()

            def begin(session: dict) -> None:
                if "encoded" in session:
                    with torch.no_grad():
                        on_device.encode(session["encoded"].to(device))

            for index, session in enumerate(planned):
                begin(session)
                for shape in sessions.steps(index, session):
                    tokens, _ = sessions.step_inputs(session, shape)
                    logits = call(tokens, shape["pos"])
                    dtype = logits.dtype
                    if label(shape) in cases:
                        expected = cases[label(shape)][1][0]
                        reference[label(shape)] = [reference_error(logits, expected, True)]
                        if measuring is not None:
                            measuring.add(label(shape), [logits])
            count = min(greedy_tokens, slots - prompt.shape[0])
            begin(planned[0])
            eager_tokens = sessions.greedy(call, prompt, count) if count else []
    except Exception as error:
        raise GoldensFailed(
            f"eager PyTorch at the model's dtype could not run its sessions on {device}: "
            f"{type(error).__name__}: {error}"
        ) from error
    log.info(
        "[goldens] %d sessions, %d judged steps, greedy %d tokens",
        len(planned),
        len(cases),
        len(eager_tokens),
    )
    return reference, dtype, eager_tokens
