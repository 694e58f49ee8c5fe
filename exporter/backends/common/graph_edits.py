"""New calls in an exported program's graph, made as export makes them: each with its fake value
(what later passes and the compilers read a node's shape and dtype from) and the provenance of
the node it is inserted before (where it came from in the model, and the torch call the fallback
policy knows it by)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._guards import detect_fake_mode

PROVENANCE = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node")


class Inserting:
    """Inserts calls before `anchor`, each with its fake value and the anchor's provenance:
    `with Inserting(graph, anchor) as make: node = make(target, *args)`."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node) -> None:
        self.graph = graph
        self.anchor = anchor
        values = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode(values)

    def __enter__(self) -> Callable[..., torch.fx.Node]:
        self._context = self.graph.inserting_before(self.anchor)
        self._context.__enter__()
        return self.make

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)

    def make(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), _value)
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        for key in PROVENANCE:
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        return node


def _value(node: torch.fx.Node) -> Any:
    return node.meta.get("val")


def tensor_value(node: object) -> torch.Tensor | None:
    """The fake tensor export recorded for `node`'s value; None where it is not a node or its
    value is not a tensor."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None
