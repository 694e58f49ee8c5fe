"""A compiled artifact's calls on CUDA replayed as CUDA graphs, one graph per call shape.

A decode step of a 1B model is some 400 small kernels; launched one by one from the host, the
launches, not the GPU, set its time (AOTInductor's package of a Llama-3.2-1B-shaped model in
bfloat16 took 3.6 ms a token on an H100, where reading its weights once takes 0.8). A graph
launches them all at once, which is what `torch.compile(mode="reduce-overhead")` does for a
model in Python.

A shape's first call runs as it is (it also warms the package up: lazy initialisation, the
autotuner's choices); its second is captured and every later one replays that graph, its inputs
copied into the graph's own tensors first. The artifact's state (a KV cache's buffers) lives at
fixed addresses, so a replay reads and writes it as a call would. What a graph cannot hold is
work that depends on an input's values on the host, which a package of an exported program,
whose shapes are its only host-side inputs, does not do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

Key = tuple[tuple[tuple[int, ...], torch.dtype], ...]


class CudaGraphs:
    """`artifact` (CUDA tensors in, a tree of CUDA tensors out) with its calls replayed as CUDA
    graphs. Outputs are copies: a replay rewrites the graph's own."""

    def __init__(self, artifact: Callable[..., object]) -> None:
        self._artifact = artifact
        self._seen: set[Key] = set()
        self._graphs: dict[Key, _Graph] = {}

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        graph = self._graphs.get(key)
        if graph is None and key in self._seen:
            graph = self._graphs[key] = _Graph(self._artifact, inputs)
        if graph is None:
            self._seen.add(key)
            return pytree.tree_leaves(self._artifact(*inputs))
        return graph.replay(inputs)


class _Graph:
    def __init__(self, artifact: Callable[..., object], inputs: Sequence[torch.Tensor]) -> None:
        self.inputs = [x.clone() for x in inputs]
        self.graph = torch.cuda.CUDAGraph()
        # Capturing records the kernels without running them: the call happens at its replay.
        with torch.cuda.graph(self.graph):
            self.outputs = pytree.tree_leaves(artifact(*self.inputs))

    def replay(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        for own, given in zip(self.inputs, inputs, strict=True):
            own.copy_(given)
        self.graph.replay()
        return [output.clone() for output in self.outputs]
