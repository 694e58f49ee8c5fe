"""How far a decode step is from what the GPU's memory allows. A batch-1 decode step reads every
weight once, and the KV cache, so reading the artifact's bytes at the card's peak memory
bandwidth takes a time no kernel can beat: the floor. A step's time over it says how much is
left to win; launches and small kernels, not bytes, are what keep a 1B model above it.

The peak is the card's own, as CUDA describes its memory: the memory clock times the bus width,
twice per clock (HBM and GDDR move data on both edges), which is the figure on the card's data
sheet (an H100 SXM's 3.35 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class MemoryDescription(Protocol):
    """What CUDA reports of a card's memory (torch.cuda.get_device_properties)."""

    name: str
    # kHz, and bits.
    memory_clock_rate: int
    memory_bus_width: int


@dataclass(frozen=True)
class MemoryFloor:
    """The card, its peak memory bandwidth and the bytes a decode step reads at least."""

    card: str
    bandwidth_bytes_per_s: float
    read_bytes: int

    @property
    def ms(self) -> float:
        return self.read_bytes / self.bandwidth_bytes_per_s * 1e3

    def ratio(self, step_ms: float) -> float:
        """A step's time over the floor (1: the card's memory could not go faster)."""
        return step_ms / self.ms

    def to_json(self) -> dict[str, object]:
        return {
            "card": self.card,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "read_bytes": self.read_bytes,
            "ms": self.ms,
        }


def peak_bandwidth(card: MemoryDescription) -> float:
    """Bytes per second: two transfers per memory clock, each the bus's width."""
    return 2 * card.memory_clock_rate * 1e3 * card.memory_bus_width / 8


def on(device: str, read_bytes: int) -> MemoryFloor | None:
    """The floor of reading `read_bytes` on `device`; None off CUDA, or where torch does not
    describe the card's memory."""
    if not device.startswith("cuda"):
        return None
    card = torch.cuda.get_device_properties(torch.device(device))
    if not getattr(card, "memory_clock_rate", 0) or not getattr(card, "memory_bus_width", 0):
        return None
    return MemoryFloor(card.name, peak_bandwidth(card), read_bytes)
