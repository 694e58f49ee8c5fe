"""Runs a GGUF checkpoint with llama.cpp, through its Python binding llama-cpp-python (which
builds llama.cpp for the machine it installs on), as an artifact with a KV cache is run: token
ids [1, S] at their positions [S] -> logits [1, S, vocab]. It is the yardstick a GGUF file's
artifacts are judged beside (quantize.llama_cpp, bench/beside_llama_cpp.py), not a runtime this
project lowers to, and not a dependency: `pip install llama-cpp-python` where it is wanted.

A call starts a session at position 0, continues one where the last call ended, or rewrites the
positions from its first on: what the cache held from there is dropped first, as an artifact's
call overwrites its slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("llama-cpp-python",)
# The positions a context holds: llama.cpp keeps every position's logits (a 128k vocabulary's
# 512 rows: 0.26 GB), so no more than a session of validation or the benchmark reaches.
CONTEXT = 512

# The threads every context computes with (set_threads), None: llama.cpp's own choice.
_threads: int | None = None


def load(path: Path, device: str) -> LlamaCpp:
    if device != "cpu":
        raise ValueError(f"llama.cpp runs here on the CPU only, not on {device}")
    return LlamaCpp(path)


def set_threads(count: int) -> None:
    global _threads
    _threads = count


class LlamaCpp:
    """A GGUF file in one llama.cpp context of `slots` positions, its calls in the three steps a
    benchmark times apart (runtimes.Loaded)."""

    clock = "cpu"

    def __init__(self, path: Path, slots: int = CONTEXT) -> None:
        import llama_cpp

        self._binding = llama_cpp
        self._llama = llama_cpp.Llama(str(path), n_ctx=slots, logits_all=True, verbose=False)
        self._threads: int | None = None

    def upload(self, inputs: Sequence[torch.Tensor]) -> tuple[list[int], int]:
        tokens, positions = inputs
        return tokens[0].tolist(), int(positions[0])

    def execute(self, resident: tuple[list[int], int]) -> tuple[int, int]:
        tokens, start = resident
        if _threads is not None and _threads != self._threads:
            self._binding.llama_set_n_threads(self._llama.ctx, _threads, _threads)
            self._threads = _threads
        # Llama.eval evaluates after its first n_tokens positions, dropping the cache's entries
        # from there on: moved back to the call's first position, it rewrites them.
        self._llama.n_tokens = start
        self._llama.eval(tokens)
        return start, len(tokens)

    def download(self, produced: tuple[int, int]) -> tuple[torch.Tensor]:
        start, count = produced
        # A view of the logits eval kept for every position, valid until a later call rewrites
        # these positions: a caller copies what it keeps.
        return (torch.from_numpy(self._llama.scores[start : start + count]).unsqueeze(0),)

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor]:
        return self.download(self.execute(self.upload(inputs)))
