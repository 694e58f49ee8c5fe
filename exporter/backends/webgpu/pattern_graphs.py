"""The Vulkan partitioner's pattern graphs, built once a process instead of twice a lowering.

ExecuTorch 1.5's WebGPU partitioner is the Vulkan one, which matches the program against
pattern graphs (RoPE, in two layouts, among them) that it builds by exporting and lowering small
modules. Its registry keeps the functions that build them as they were before `lru_cache` wrapped
them, so partitioning and preprocessing build every graph again in each lowering: about half of
lowering a small program, and a localization search lowers several. The graphs are only matched
against, never changed, so one build serves every lowering of the process.
"""

from __future__ import annotations

import functools

from executorch.backends.vulkan.patterns import fusable_patterns

_cached: set[str] = set()


def build_once() -> None:
    """Wraps each registered pattern's graph builder in a cache, once a process."""
    for name, entry in fusable_patterns.items():
        if entry.get_graphs_fn is not None and name not in _cached:
            entry.get_graphs_fn = functools.cache(entry.get_graphs_fn)
            _cached.add(name)
