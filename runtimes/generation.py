"""Text generation with the artifact of a causal LM with a static KV cache, on one loaded
instance: the prompt in one prefill from position 0, then a decode step per new token, each token
chosen from the last position's logits (the most likely, or drawn at a temperature among the
top k), until the count asked for or one of the model's EOS ids.

The artifact is called through runtimes/verdict/sessions.py's `Cache`, as the check replays its
sessions: a call that does not follow on from the one before, or that runs past the cache's last
slot, is refused before the artifact sees it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.sessions import Cache, CacheRefused


@dataclass(frozen=True)
class Sampling:
    """How each new token is chosen from the logits: the most likely (temperature 0, greedy, as
    the check's generation chooses), or drawn from their softmax at `temperature`, among the
    `top_k` most likely where set, by a generator seeded with `seed` (the same seed and logits
    draw the same tokens)."""

    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        top_k = f", top-k {self.top_k}" if self.top_k is not None else ""
        return f"sampled at temperature {self.temperature:g}{top_k}, seed {self.seed}"

    def choose(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """The next token, from the last position's logits [vocab]."""
        if self.greedy:
            return int(logits.float().argmax())
        # float64: a float16 model's logits divided by a small temperature would overflow.
        scaled = logits.double() / self.temperature
        candidates = torch.arange(scaled.numel())
        if self.top_k is not None:
            scaled, candidates = scaled.topk(min(self.top_k, scaled.numel()))
        drawn = torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator)
        return int(candidates[drawn])


@dataclass(frozen=True)
class Generated:
    prompt_tokens: int
    tokens: tuple[int, ...]
    prefill_ms: float
    # One decode step per token after the first, which the prefill's logits give.
    decode_ms: tuple[float, ...]
    # The EOS id it stopped at, the last of `tokens`; None: it generated as many as asked.
    eos: int | None

    def figures(self, sampling: Sampling) -> str:
        """`prompt 5 tokens, generated 20 (greedy), prefill 3.1 ms, decode 0.52 ms/token
        (median of 19 steps)`."""
        stop = f", stopped at EOS {self.eos}" if self.eos is not None else ""
        decode = (
            f"decode {statistics.median(self.decode_ms):.2f} ms/token (median of "
            f"{len(self.decode_ms)} steps)"
            if self.decode_ms
            else "no decode step"
        )
        return (
            f"prompt {self.prompt_tokens} tokens, generated {len(self.tokens)} "
            f"({sampling.describe()}{stop}), prefill {self.prefill_ms:.1f} ms, {decode}"
        )


def generate(
    cache: Cache,
    prompt: Sequence[int],
    count: int,
    eos_ids: Collection[int],
    sampling: Sampling,
    on_token: Callable[[int], None] = lambda token: None,
) -> Generated:
    """Up to `count` tokens after `prompt` by `cache`'s artifact, in a new session (from position
    0), each handed to `on_token` as it is chosen; it stops after an EOS id. The times are the
    artifact's calls alone, not what `on_token` does with a token."""
    if count < 1:
        raise ValueError(f"generate makes at least 1 token, not {count}")
    generator = torch.Generator().manual_seed(sampling.seed)
    started = time.perf_counter()
    logits = _call(cache, torch.tensor([list(prompt)]), 0)
    prefill_ms = (time.perf_counter() - started) * 1e3
    tokens: list[int] = []
    decode_ms: list[float] = []
    position = len(prompt)
    while True:
        token = sampling.choose(logits[0, -1], generator)
        tokens.append(token)
        on_token(token)
        if token in eos_ids or len(tokens) == count:
            break
        started = time.perf_counter()
        logits = _call(cache, torch.tensor([[token]]), position)
        decode_ms.append((time.perf_counter() - started) * 1e3)
        position += 1
    eos = tokens[-1] if tokens[-1] in eos_ids else None
    return Generated(len(prompt), tuple(tokens), prefill_ms, tuple(decode_ms), eos)


def _call(cache: Cache, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """The artifact's logits [1, n, vocab] for `tokens` [1, n] at positions start..start+n-1."""
    try:
        return cache.call(tokens, start)[0]
    except CacheRefused:
        raise
    except Exception as error:
        raise ArtifactFailed(
            f"the artifact failed at position {start} ({tokens.shape[-1]} tokens): "
            f"{type(error).__name__}: {error}"
        ) from error
