"""The exported program rewritten into ops XNNPACK's delegate takes, with the same numbers.

ExecuTorch's XNNPACK partitioner refuses a reshape with a symbolic size, an unsqueeze before
the last dim, an expand, a mean over the last dim of a rank-3 tensor, and every op of a boolean
mask; and the standard decomposition of scaled_dot_product_attention adds per layer a 4-D view
with two dynamic dims and a "safe softmax" of comparisons on portable kernels. Each refusal
splits a delegate and runs on ExecuTorch's portable kernels, slower than eager PyTorch on the
whole. Rewritten here, before ExecuTorch decomposes the program:

- a boolean attention mask that is the causal mask at every seq the program accepts (checked
  by computing it at each) becomes an additive mask built once from the positions;
- scaled_dot_product_attention with such a mask (or none) becomes bmm, softmax, bmm over
  [batch * heads, seq, head_dim];
- a reshape, view or unsqueeze whose result has one dynamic dim takes -1 for it;
- an expand of a size-1 dim to a static size becomes a concatenation of copies;
- a mean over the last dim becomes XNNPACK's mean over the two inner dims of a 4-D view.

A graph pass of the lowering rather than a change to the model: the program saved as
program.pt2 stays the model's own (eager runs it), and any transformers architecture whose
traced ops match gains, not only Llama. `for_xnnpack` applies them all; `rewritten` the ones a
backend names (backend=webgpu's partitioner gains from the mask, attention and rotate_half
rewrites too). The rewrites that change arithmetic (attention, mean)
apply to float32 and float16, the dtypes XNNPACK computes in.

Apart from these, `without_wrong_kernels` rewrites the ops XNNPACK's kernels compute as another
function than the op asks, measured by lowering each op alone (tests/test_wrong_kernels.py):
its gelu computes the exact (erf) GELU whatever `approximate` says, so a tanh-GELU (Gemma's
activation) becomes the tanh formula in mul, tanh and add, which XNNPACK computes right, in the
same delegate. The backend applies it under `fallback.wrong_kernels=avoid`, the default.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import sympy
import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram
from torch.export.exported_program import InputKind, InputSpec, TensorArgument
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from exporter.artifact.partition import WrongKernelAvoided
from exporter.backends.common.graph_edits import Inserting, tensor_value

aten = torch.ops.aten

_XNNPACK_DTYPES = (torch.float32, torch.float16)
# XNNPACK concatenates at most five tensors in one op.
_MOST_CONCATENATED = 5
# Sizes the causal-mask check computes the mask at, at most: every size of a range this long,
# beyond it the ends of the range and the powers of two in it.
_MASK_CHECKS = 512
_EDGE_VIEW = exir_ops.edge.aten.view_copy.default
_EDGE_UNSQUEEZE = exir_ops.edge.aten.unsqueeze_copy.default
_EDGE_CAT = exir_ops.edge.aten.cat.default


# The rewrites by name, in the order they apply: attention first, as it drops the boolean mask
# whose ops the others would otherwise see.
REWRITES = ("attention", "rotations", "expands", "means", "aliases")
# The rewrites of ops XNNPACK computes as another function.
WRONG_KERNEL_REWRITES = ("tanh_gelus",)

# What XNNPACK's gelu computes, measured on one float32 tanh-GELU lowered alone, inputs in [-4, 4].
_TANH_GELU_WHY = (
    "XNNPACK's gelu computes the exact (erf) GELU whatever approximate says: 4.7e-4 off "
    "tanh-GELU on inputs in [-4, 4], 1700 times eager's error (the rewrite: 1.6 times)"
)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def for_xnnpack(program: ExportedProgram) -> ExportedProgram:
    """A copy of `program` (its weights shared) with the rewrites above applied."""
    return rewritten(program, REWRITES)


def without_wrong_kernels(
    program: ExportedProgram,
) -> tuple[ExportedProgram, tuple[WrongKernelAvoided, ...]]:
    """A copy of `program` (its weights shared) where every op XNNPACK computes wrongly is
    rewritten into ops it computes right; and those nodes, for the partition report."""
    result, rewriter = _rewritten(program, WRONG_KERNEL_REWRITES)
    return result, tuple(rewriter.wrong_kernels_avoided)


def rewritten(program: ExportedProgram, rewrites: tuple[str, ...]) -> ExportedProgram:
    """A copy of `program` (its weights shared) with the named rewrites of REWRITES applied:
    another backend takes the ones its partitioner and kernels gain from."""
    return _rewritten(program, rewrites)[0]


def _rewritten(
    program: ExportedProgram, rewrites: tuple[str, ...]
) -> tuple[ExportedProgram, _Rewriter]:
    known = REWRITES + WRONG_KERNEL_REWRITES
    unknown = set(rewrites) - set(known)
    if unknown:
        raise ValueError(f"no rewrite named {sorted(unknown)}; the rewrites are {known}")
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    outputs = graph.graph_copy(program.graph, copies)
    graph.output(outputs)
    # The copy may rename a placeholder (an input named `input` becomes `input_1`: fx keeps
    # Python's builtins free); the signature must follow.
    renamed = {old.name: new.name for old, new in copies.items() if old.name != new.name}
    # ExecuTorch drops export's dtype assertions; dropped first, they keep no mask alive.
    for node in list(graph.nodes):
        if node.target == aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    rewriter = _Rewriter(program, graph)
    for name in known:
        if name in rewrites:
            getattr(rewriter, name)()
    graph.eliminate_dead_code()
    signature = copy.copy(program.graph_signature)
    specs = [
        dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=renamed[spec.arg.name]))
        if getattr(spec.arg, "name", None) in renamed
        else spec
        for spec in program.graph_signature.input_specs
    ]
    users = [i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT]
    at = users[0] if users else len(specs)
    signature.input_specs = [*specs[:at], *rewriter.added_specs, *specs[at:]]
    # An output that a rewrite replaced is known by its replacement's name.
    (returned,) = graph.output_node().args
    signature.output_specs = [
        dataclasses.replace(spec, arg=TensorArgument(node.name))
        if isinstance(spec.arg, TensorArgument)
        else spec
        for spec, node in zip(program.graph_signature.output_specs, returned, strict=True)
    ]
    result = ExportedProgram(
        root=program.graph_module,
        graph=graph,
        graph_signature=signature,
        state_dict={**program.state_dict, **rewriter.added_buffers},
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[program.verifier],
    )
    return result, rewriter


class _Rewriter:
    def __init__(self, program: ExportedProgram, graph: torch.fx.Graph) -> None:
        self.program = program
        self.graph = graph
        signature = program.graph_signature
        self.constants: dict[str, torch.Tensor] = {}
        for spec in signature.input_specs:
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                self.constants[spec.arg.name] = program.state_dict.get(
                    spec.target, program.constants.get(spec.target)
                )
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                self.constants[spec.arg.name] = program.constants[spec.target]
        # Additive masks already built, by the boolean mask they replace.
        self.additive_masks: dict[torch.fx.Node, torch.fx.Node] = {}
        # Weights the rewrites add, as buffers: ExecuTorch copies a buffer that several delegates
        # take for each of them, but fails to rebuild a lifted tensor constant taken so.
        self.added_specs: list[InputSpec] = []
        self.added_buffers: dict[str, torch.Tensor] = {}
        self.rotation_weights: dict[tuple[int, torch.dtype], torch.fx.Node] = {}
        self.wrong_kernels_avoided: list[WrongKernelAvoided] = []

    # scaled_dot_product_attention and its causal mask

    def attention(self) -> None:
        for node in self._calls(aten.scaled_dot_product_attention.default):
            query, key, value = node.args[:3]
            mask = _arg(node, 3, "attn_mask", None)
            if not self._plain_attention(node, query, key, value):
                continue
            additive = None
            if mask is not None:
                additive = self._additive_causal_mask(mask, query)
                if additive is None:
                    continue
            self._replace(node, self._attention_as_bmm(node, query, key, value, additive))

    def _plain_attention(self, node: torch.fx.Node, *qkv: torch.fx.Node) -> bool:
        """Attention that the bmm form computes alike: no dropout, no is_causal (a mask says
        it), as many key and value heads as query heads, every dim static but the sequences."""
        if _arg(node, 4, "dropout_p", 0.0) != 0.0 or _arg(node, 5, "is_causal", False):
            return False
        if _arg(node, 7, "enable_gqa", False):
            return False
        values = [tensor_value(x) for x in qkv]
        if any(v is None or v.dim() != 4 or v.dtype not in _XNNPACK_DTYPES for v in values):
            return False
        query, key, value = values
        kept = [d for v in values for d in (v.shape[0], v.shape[1], v.shape[3])]
        if not all(isinstance(d, int) for d in kept):
            return False
        return query.shape[:2] == key.shape[:2] == value.shape[:2]

    def _attention_as_bmm(
        self,
        node: torch.fx.Node,
        query: torch.fx.Node,
        key: torch.fx.Node,
        value: torch.fx.Node,
        additive: torch.fx.Node | None,
    ) -> torch.fx.Node:
        batch, heads, _, head_dim = tensor_value(query).shape
        value_dim = tensor_value(value).shape[3]
        scale = _arg(node, 6, "scale", None)
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        with self._inserting_before(node) as make:
            rows = batch * heads
            query3 = make(aten.reshape.default, query, [rows, -1, head_dim])
            key3 = make(aten.reshape.default, key, [rows, -1, head_dim])
            value3 = make(aten.reshape.default, value, [rows, -1, value_dim])
            scaled = make(aten.mul.Tensor, query3, scale)
            scores = make(aten.bmm.default, scaled, make(aten.transpose.int, key3, 1, 2))
            if additive is not None:
                scores = make(aten.add.Tensor, scores, additive)
            weights = make(aten._softmax.default, scores, -1, False)
            out = make(aten.bmm.default, weights, value3)
            return make(aten.reshape.default, out, [batch, heads, -1, value_dim])

    def _additive_causal_mask(
        self, mask: torch.fx.Node, query: torch.fx.Node
    ) -> torch.fx.Node | None:
        """An additive [seq, seq] mask (0 where a position sees, the dtype's lowest where it
        does not) for `mask`, where `mask` is the boolean causal mask at every seq; None where
        it is not, or depends on more than the seq."""
        if mask in self.additive_masks:
            return self.additive_masks[mask]
        seq = self._causal_seq(mask)
        if seq is None:
            return None
        dtype = tensor_value(query).dtype
        with self._inserting_before(mask) as make:
            positions = make(aten.arange.default, seq, dtype=dtype, device=torch.device("cpu"))
            rows = make(aten.reshape.default, positions, [-1, 1])
            columns = make(aten.reshape.default, positions, [1, -1])
            # Integers (exact in any float): > 0 where the column is a later position.
            ahead = make(aten.sub.Tensor, columns, rows)
            hidden = make(aten.clamp.default, ahead, 0.0, 1.0)
            # The lowest finite value, not -inf: 0 * -inf would be NaN. Added to a score it
            # still gives exp() == 0 in softmax, as -inf does; every row sees its own position.
            additive = make(aten.mul.Tensor, hidden, torch.finfo(dtype).min)
        self.additive_masks[mask] = additive
        return additive

    def _causal_seq(self, mask: torch.fx.Node) -> torch.fx.Node | None:
        """The node of the seq size that `mask` is the causal mask of, computed from it alone;
        None where the mask is anything else."""
        value = tensor_value(mask)
        if value is None or value.dtype != torch.bool or value.dim() < 2:
            return None
        rows, columns = value.shape[-2:]
        if not isinstance(rows, torch.SymInt) or not _same_symbol(rows, columns):
            return None
        if any(d != 1 for d in value.shape[:-2]):
            return None
        subgraph = _ancestors(mask)
        sizes = [n for n in subgraph if n.target == aten.sym_size.int]
        if not sizes or not all(_same_symbol(n.meta.get("val"), rows) for n in sizes):
            return None
        inputs = [n for n in subgraph if n.op == "placeholder"]
        if any(n.name not in self.constants and not _only_sized(n, subgraph) for n in inputs):
            return None
        if any(n.op not in ("placeholder", "call_function") for n in subgraph):
            return None
        low, high = _bounds(self.program, rows)
        for seq in _sizes_to_check(low, high):
            computed = self._computed(mask, subgraph, seq)
            causal = torch.ones(seq, seq, dtype=torch.bool).tril()
            if computed is None or computed.shape[-2:] != causal.shape:
                return None
            if not bool((computed == causal).all()):
                return None
        return sizes[0]

    def _computed(
        self, target: torch.fx.Node, subgraph: list[torch.fx.Node], seq: int
    ) -> torch.Tensor | None:
        """`target`'s value where every size of the seq symbol is `seq`."""
        env: dict[torch.fx.Node, Any] = {}
        for node in subgraph:
            if node.op == "placeholder":
                env[node] = self.constants.get(node.name)
            elif node.target == aten.sym_size.int:
                env[node] = seq
            else:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                try:
                    env[node] = node.target(*args, **kwargs)
                except Exception:  # a mask not computable on its own is not rewritten
                    return None
        result = env[target]
        return result if isinstance(result, torch.Tensor) else None

    # reshapes, expands, means

    def expands(self) -> None:
        """An expand of size-1 dims to static sizes: copies concatenated along each (repeat_kv
        of grouped-query attention). XNNPACK has no expand; its concatenation takes up to five
        tensors, so more copies concatenate in steps."""
        for node in self._calls(aten.expand.default):
            source = tensor_value(node.args[0])
            value = tensor_value(node)
            if source is None or value is None or source.dtype not in _XNNPACK_DTYPES:
                continue
            grown = _grown_dims(source, value)
            if not grown:
                continue
            with self._inserting_before(node) as make:
                result = node.args[0]
                for dim, size in grown:
                    result = _concatenated(make, [result] * size, dim)
                self._replace(node, result)

    def means(self) -> None:
        """A mean over the last dim, kept: the mean over the two inner dims of the 4-D view
        [1, rows, last, 1], which is XNNPACK's global average pooling."""
        for node in self._calls(aten.mean.dim):
            value = tensor_value(node.args[0])
            dims = node.args[1]
            keepdim = _arg(node, 2, "keepdim", False)
            if value is None or value.dtype not in _XNNPACK_DTYPES or len(node.kwargs) > 0:
                continue
            if value.dim() in (0, 4) or list(dims) not in ([-1], [value.dim() - 1]):
                continue
            last = value.shape[-1]
            if not isinstance(last, int) or not keepdim:
                continue
            out_shape = [d if isinstance(d, int) else -1 for d in tensor_value(node).shape]
            if out_shape.count(-1) > 1:
                continue
            with self._inserting_before(node) as make:
                four = make(aten.reshape.default, node.args[0], [1, -1, last, 1])
                mean = make(aten.mean.dim, four, [2, 3], True)
                self._replace(node, make(aten.reshape.default, mean, out_shape))

    def rotations(self) -> None:
        """rotate_half of rotary embeddings, cat([-x2, x1]) of the last dim's halves, as a
        linear layer whose weight moves and negates them: XNNPACK slices no tensor with a
        dynamic dim. Exact: each output is one input times +-1 plus products with zero."""
        for node in self._calls(aten.cat.default):
            source = _rotated_half(node)
            if source is None:
                continue
            value = tensor_value(source)
            weight = self._rotation_weight(value.shape[-1], value.dtype)
            with self._inserting_before(node) as make:
                self._replace(node, make(aten.linear.default, source, weight))

    def _rotation_weight(self, size: int, dtype: torch.dtype) -> torch.fx.Node:
        if (size, dtype) in self.rotation_weights:
            return self.rotation_weights[(size, dtype)]
        half = size // 2
        weight = torch.zeros(size, size, dtype=dtype)
        rows = torch.arange(half)
        # output i < half is -input[i + half]; output i >= half is input[i - half].
        weight[rows, rows + half] = -1
        weight[rows + half, rows] = 1
        name = f"_xnnpack_rotate_half_{size}_{str(dtype).removeprefix('torch.')}"
        # Among the constants, before the user's inputs, as the signature lists them.
        user_inputs = {
            spec.arg.name
            for spec in self.program.graph_signature.input_specs
            if spec.kind == InputKind.USER_INPUT
        }
        first_input = next(
            n for n in self.graph.nodes if n.op == "placeholder" and n.name in user_inputs
        )
        with self.graph.inserting_before(first_input):
            placeholder = self.graph.placeholder(name)
        fake_mode = Inserting(self.graph, first_input).fake_mode
        placeholder.meta["val"] = fake_mode.from_tensor(weight, static_shapes=True)
        self.added_specs.append(
            InputSpec(InputKind.BUFFER, TensorArgument(name), target=name, persistent=True)
        )
        self.added_buffers[name] = weight
        self.rotation_weights[(size, dtype)] = placeholder
        return placeholder

    def tanh_gelus(self) -> None:
        """gelu(x, approximate="tanh") in float32, the dtype XNNPACK takes gelu in, as
        0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), PyTorch's formula."""
        for node in self._calls(aten.gelu.default):
            value = tensor_value(node.args[0])
            if value is None or value.dtype != torch.float32:
                continue
            if _arg(node, 1, "approximate", "none") != "tanh":
                continue
            x, name = node.args[0], node.name
            with self._inserting_before(node) as make:
                cube = make(aten.mul.Tensor, make(aten.mul.Tensor, x, x), x)
                inner = make(aten.add.Tensor, x, make(aten.mul.Tensor, cube, 0.044715))
                tanh = make(aten.tanh.default, make(aten.mul.Tensor, inner, _SQRT_2_OVER_PI))
                half = make(aten.mul.Tensor, x, 0.5)
                self._replace(node, make(aten.mul.Tensor, half, make(aten.add.Tensor, tanh, 1.0)))
            remedy = "rewritten into mul, tanh and add"
            self.wrong_kernels_avoided.append(
                WrongKernelAvoided(name, "aten.gelu.default", remedy, _TANH_GELU_WHY)
            )

    def aliases(self) -> None:
        """An alias (transformers' logits[:, -0:]) is its input: on ExecuTorch's portable
        kernels it would copy the logits."""
        for node in self._calls(aten.alias.default):
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.op == "call_function":
                self._replace(node, source)

    # graph editing

    def _calls(self, target: Any) -> list[torch.fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function" and n.target == target]

    def _inserting_before(self, anchor: torch.fx.Node) -> Inserting:
        return Inserting(self.graph, anchor)

    def _replace(self, node: torch.fx.Node, replacement: torch.fx.Node) -> None:
        node.replace_all_uses_with(replacement)
        self.graph.erase_node(node)


def _concatenated(
    make: Callable[..., torch.fx.Node], parts: list[torch.fx.Node], dim: int
) -> torch.fx.Node:
    while len(parts) > 1:
        parts = [
            make(aten.cat.default, parts[i : i + _MOST_CONCATENATED], dim)
            if len(parts[i : i + _MOST_CONCATENATED]) > 1
            else parts[i]
            for i in range(0, len(parts), _MOST_CONCATENATED)
        ]
    return parts[0]


def _rotated_half(cat: torch.fx.Node) -> torch.fx.Node | None:
    """x where `cat` is cat([-x[..., half:], x[..., :half]], -1) of an even last dim."""
    parts = cat.args[0]
    value = tensor_value(cat)
    if len(parts) != 2 or value is None or value.dtype not in _XNNPACK_DTYPES:
        return None
    last = value.dim() - 1
    if _arg(cat, 1, "dim", 0) not in (-1, last):
        return None
    negated, first = parts
    if negated.target != aten.neg.default:
        return None
    second = negated.args[0]
    if first.target != aten.slice.Tensor or second.target != aten.slice.Tensor:
        return None
    source = first.args[0]
    size = value.shape[-1]
    if not isinstance(size, int) or size % 2 or second.args[0] is not source:
        return None
    half = size // 2
    if tensor_value(source) is None or tensor_value(source).shape[-1] != size:
        return None
    if _slice_bounds(first, last) != (0, half) or _slice_bounds(second, last) != (half, size):
        return None
    return source


def _slice_bounds(node: torch.fx.Node, last: int) -> tuple[int, int] | None:
    given = list(node.args[1:4])
    dim, start, end = given + [0, None, None][len(given) :]
    start = 0 if start is None else start
    step = _arg(node, 4, "step", 1)
    if dim not in (-1, last) or step != 1 or not isinstance(start, int):
        return None
    size = tensor_value(node.args[0]).shape[-1]
    end = size if end is None or (isinstance(end, int) and end >= size) else end
    return start, end


def _grown_dims(source: torch.Tensor, value: torch.Tensor) -> list[tuple[int, int]]:
    """(dim, size) of each size-1 dim an expand grows to a static size; empty where it grows
    one to a dynamic size (or is no expand of a same-rank tensor)."""
    if source.dim() != value.dim():
        return []
    grown = []
    for dim, (was, size) in enumerate(zip(source.shape, value.shape, strict=True)):
        if not (isinstance(was, int) and was == 1):
            continue
        if not isinstance(size, int):
            return []
        if size > 1:
            grown.append((dim, size))
    return grown


def _arg(node: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _same_symbol(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.SymInt) or not isinstance(b, torch.SymInt):
        return False
    expr = a.node.expr
    return isinstance(expr, sympy.Symbol) and expr == b.node.expr


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and everything it is computed from, in graph order."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _only_sized(placeholder: torch.fx.Node, subgraph: list[torch.fx.Node]) -> bool:
    """The subgraph reads only the sizes of `placeholder`, not its values."""
    users = [u for u in placeholder.users if u in subgraph]
    return all(u.target == aten.sym_size.int for u in users)


def _bounds(program: ExportedProgram, size: torch.SymInt) -> tuple[int, int]:
    bounds = program.range_constraints[size.node.expr]
    return int(bounds.lower), int(bounds.upper)


def _sizes_to_check(low: int, high: int) -> Iterator[int]:
    if high - low < _MASK_CHECKS:
        yield from range(low, high + 1)
        return
    powers = [2**k for k in range(high.bit_length()) if low <= 2**k <= high]
    yield from sorted({*range(low, low + 8), *powers, *range(high - 7, high + 1)})


class ViewsForXnnpack(PassBase):
    """On the edge program, after ExecuTorch's decompositions: a view_copy (or an unsqueeze_copy
    before the last dim) to a shape with one dynamic dim takes -1 for it, where it named its
    size by a symbolic value, which XNNPACK refuses (decomposing a reshape names every size);
    and a cat that takes one tensor twice takes a view of it the second time: XNNPACK's
    partitioner counts distinct inputs and refuses a cat of "one"."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target == _EDGE_VIEW and any(not isinstance(d, int) for d in node.args[1]):
                shape = _inferred_shape(node)
                if shape is not None:
                    node.args = (node.args[0], shape)
                    changed = True
            elif node.target == _EDGE_UNSQUEEZE and node.args[1] not in (
                -1,
                tensor_value(node.args[0]).dim(),
            ):
                shape = _inferred_shape(node)
                if shape is not None:
                    with graph.inserting_before(node):
                        view = graph.call_function(_EDGE_VIEW, (node.args[0], shape))
                    view.meta = dict(node.meta)
                    node.replace_all_uses_with(view)
                    graph.erase_node(node)
                    changed = True
            elif node.target == _EDGE_CAT:
                changed |= _distinct_cat_inputs(graph, node)
        if changed:
            graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, changed)


def _distinct_cat_inputs(graph: torch.fx.Graph, cat: torch.fx.Node) -> bool:
    parts = list(cat.args[0])
    seen: set[torch.fx.Node] = set()
    changed = False
    for i, part in enumerate(parts):
        if part in seen:
            shape = _inferred_shape(part)
            if shape is None:
                return changed
            with graph.inserting_before(cat):
                view = graph.call_function(_EDGE_VIEW, (part, shape))
            view.meta = dict(part.meta)
            parts[i] = view
            changed = True
        seen.add(part)
    if changed:
        cat.args = (parts, *cat.args[1:])
    return changed


def _inferred_shape(node: torch.fx.Node) -> list[int] | None:
    """`node`'s shape with -1 for its one dynamic dim; None where it has more than one."""
    value = tensor_value(node)
    if value is None:
        return None
    shape = [d if isinstance(d, int) else -1 for d in value.shape]
    return shape if shape.count(-1) <= 1 else None
