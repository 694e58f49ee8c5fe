"""The verdict on an artifact with a KV cache: sessions of a prefill and decode steps, one token
at a time to the last cache slot, run in order on one loaded instance and judged at their
sampled steps; then a greedy generation beside eager's and the oracle's.

A session as the goldens keep it (plain containers, so that torch.load(weights_only=True) reads
them) is a dict: `tokens`, the session's token ids [max_cache_len]; `prefill`, how many of them
the first call takes; `judged`, the positions of the decode steps compared with the goldens
(the prefill always is); `encoded`, where the model's decoder attends to an encoded input
(Whisper's clip of audio), that input, which the artifact's encode method reads as the session
starts. A session after the first starts where a full cache was left: an entry of the session
before must not leak into it.

The positions an artifact is given are its cache's write slots, which it trusts: a call whose
positions do not follow on from the call before, or run past the cache's last slot, would read
another session's entries or write outside the cache. `Cache` refuses both before the artifact
sees them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from runtimes import Loaded
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.goldens import Goldens
from runtimes.verdict.report import Execution, Generation, Report, Session
from runtimes.verdict.shapes import SAME_INSTANCE, LiveShape, label
from runtimes.verdict.stats import Tolerances


class CacheRefused(ValueError):
    """A call the cache cannot take: positions past its last slot, or not following on."""


class Cache:
    """One loaded artifact's KV cache, as the calls fill it: each call's positions must start
    at 0 (a new session) or where the call before ended, and end within the cache."""

    def __init__(self, loaded: Loaded, slots: int) -> None:
        self.loaded = loaded
        self.slots = slots
        self.filled = 0

    def call(
        self, tokens: torch.Tensor, start: int, encoded: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The artifact's outputs for `tokens` [1, n] at positions start..start+n-1; a session
        that starts (at 0) with `encoded` has the artifact's encode method read it first."""
        count = tokens.shape[-1]
        if start not in (0, self.filled):
            raise CacheRefused(
                f"positions {start}..{start + count - 1} do not follow on from the cache's "
                f"{self.filled} filled slots: a session continues at position {self.filled} or "
                "starts again at 0."
            )
        if start + count > self.slots:
            raise CacheRefused(
                f"positions {start}..{start + count - 1} run past the cache's last slot "
                f"({self.slots - 1}; model.max_cache_len={self.slots}): start a new session at "
                "position 0."
            )
        if encoded is not None:
            if start != 0:
                raise CacheRefused(
                    f"an encoded input starts a session, at position 0, not at {start}."
                )
            self.loaded.encode((encoded,))
        outputs = self.loaded.run((tokens, torch.arange(start, start + count)))
        self.filled = start + count
        return outputs


def step_shape(session: int, start: int, count: int) -> LiveShape:
    """A call of a session as the report names it: session=0,pos=7,seq=1."""
    return {"session": session, "pos": start, "seq": count}


def steps(session: int, plan: dict) -> list[LiveShape]:
    """Every call of the session in order: its prefill, then one decode step per slot left."""
    prefill, slots = int(plan["prefill"]), len(plan["tokens"])
    return [step_shape(session, 0, prefill)] + [
        step_shape(session, position, 1) for position in range(prefill, slots)
    ]


def judged(session: int, plan: dict) -> list[LiveShape]:
    """The calls of the session compared with the goldens: its prefill and its sampled steps."""
    positions = {0, *(int(p) for p in plan["judged"])}
    return [s for s in steps(session, plan) if s["pos"] in positions]


def outline(sessions: Sequence[dict]) -> list[dict]:
    """The sessions as a bundle's manifest lists them: each one's prefill, its calls and the
    positions judged."""
    return [
        {
            "session": number,
            "prefill": int(plan["prefill"]),
            "steps": len(steps(number, plan)),
            "judged": [shape["pos"] for shape in judged(number, plan)],
        }
        for number, plan in enumerate(sessions)
    ]


def step_inputs(plan: dict, shape: LiveShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's token ids [1, seq] and positions [seq]."""
    start, count = shape["pos"], shape["seq"]
    return plan["tokens"][start : start + count].unsqueeze(0), torch.arange(start, start + count)


def calls_up_to(
    planned: Sequence[dict], shape: LiveShape
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The inputs of every call that one instance running the sessions in order takes up to
    the step `shape`, judged or not: the sessions before its own, then its steps up to it. A
    cache holds there what these calls wrote (an earlier session's entries too)."""
    calls = []
    for index, plan in enumerate(planned[: shape["session"] + 1]):
        for step in steps(index, plan):
            if index == shape["session"] and step["pos"] > shape["pos"]:
                break
            calls.append(step_inputs(plan, step))
    return calls


def greedy(
    call: Callable[[torch.Tensor, int], torch.Tensor], prompt: torch.Tensor, count: int
) -> list[int]:
    """`count` tokens generated greedily after `prompt` [n] by `call(tokens [1, k], start)`, which
    returns the logits [1, k, vocab] of a cache that it keeps."""
    logits = call(prompt.unsqueeze(0), 0)
    tokens: list[int] = []
    position = prompt.shape[0]
    for _ in range(count):
        token = int(logits[0, -1].float().argmax())
        tokens.append(token)
        if len(tokens) == count:
            break
        logits = call(torch.tensor([[token]]), position)
        position += 1
    return tokens


def run(
    output_names: Sequence[str],
    load: Callable[[], Loaded],
    goldens: Goldens,
    tolerances: Tolerances,
    judge: Callable[[Sequence[torch.Tensor], LiveShape], tuple],
    after_each: Callable[[int, Execution], None] = lambda number, execution: None,
) -> Report:
    """Every session's calls in order on one instance that `load` makes, each judged call
    compared with its goldens by `judge(outputs, shape)` as it ends (`after_each(number,
    execution)` after it, from 1), then the greedy generation on the same instance."""
    slots = len(goldens.sessions[0]["tokens"])
    instance = load()
    cache = Cache(instance, slots)
    done: list[Execution] = []
    judged_shapes: list[LiveShape] = []
    for session, plan in enumerate(goldens.sessions):
        compared = {label(shape) for shape in judged(session, plan)}
        for shape in steps(session, plan):
            tokens, _ = step_inputs(plan, shape)
            start = time.perf_counter()
            encoded = plan.get("encoded") if shape["pos"] == 0 else None
            try:
                outputs = cache.call(tokens, shape["pos"], encoded)
            except CacheRefused:
                raise
            except Exception as error:
                raise ArtifactFailed(
                    f"the artifact failed at {label(shape)}: {type(error).__name__}: {error}"
                ) from error
            if label(shape) not in compared:
                continue
            wall_ms = (time.perf_counter() - start) * 1e3
            judged_shapes.append(shape)
            done.append(Execution(shape, SAME_INSTANCE, wall_ms, judge(outputs, shape)))
            after_each(len(done), done[-1])
    generation = None
    if goldens.greedy is not None:
        expected = goldens.greedy

        def call(tokens: torch.Tensor, start: int) -> torch.Tensor:
            encoded = expected.get("encoded") if start == 0 else None
            return cache.call(tokens, start, encoded)[0]

        generation = Generation(
            [int(t) for t in expected["prompt"]],
            greedy(call, expected["prompt"], len(expected["oracle"])),
            [int(t) for t in expected["eager"]],
            [int(t) for t in expected["oracle"]],
        )
    target = getattr(instance, "target", {})
    return Report(
        tolerances,
        tuple(output_names),
        tuple(judged_shapes),
        tuple(done),
        target,
        generation=generation,
        sessions=tuple(
            Session(int(plan["prefill"]), len(steps(number, plan)))
            for number, plan in enumerate(goldens.sessions)
        ),
    )
