"""The decode step's attention as one Triton kernel (and a combine): where the decode step's
graph (exporter/backends/aoti.py) computes SDPA of one query over a KV cache that `index_copy_` has
just written the new key and value into (through transformers' repeat_kv, or with enable_gqa),
with a boolean mask over the slots, `decode_attention` does all of it: it writes the cache, reads
only the slots the mask lets through, and where q and k come from RoPE (x * cos + rotate_half(x) *
sin) with the same cos and sin, rotates them itself. Registered as a `torch.library.triton_op`,
AOTInductor compiles it into the package.

The slots are split over programs (8 splits where they are a multiple of 512), each split's
softmax-weighted values summed unnormalized beside their largest score and their weights' sum,
and a second launch combines a head's splits. Every sum is float32; the output is rounded once.
Inductor's decode step had computed the cache write and RoPE in its projections' kernels and the
attention with cuDNN's SDPA over every slot, and a reduction after it (docs/backends.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.export import ExportedProgram
from torch.library import triton_op, wrap_triton

from exporter.backends.common.graph_edits import Inserting, tensor_value

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
# Views between the cache that index_copy_ wrote and SDPA's k and v: transformers' repeat_kv.
_REPEAT_KV = (aten.unsqueeze.default, aten.expand.default, aten.reshape.default, aten.view.default)
# Calls whose value is their tensor argument's (copy_: its source's), where dtype and device
# agree.
_SAME_VALUE = (aten.copy_.default, aten.to.dtype, aten.to.dtype_layout)
# Views that may leave a tensor's values in order, which `_unviewed` looks through.
_VIEWS = (
    *_REPEAT_KV, aten._unsafe_view.default, aten.squeeze.dim, aten.transpose.int,
    aten.slice.Tensor,
)  # fmt: skip
# The activations it computes in (each sum float32).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Slots a step of the attention reads, and the splits of the cache's slots over programs.
SLOT_BLOCK = 64
SLOT_SPLITS = 8


def rewritten(program: ExportedProgram) -> int:
    """Rewrites `program`'s graph in place (the module docstring), which must be the decode
    step's own; how many attentions it rewrote."""
    graph, signature = program.graph, program.graph_signature
    inputs = set(signature.user_inputs) - set(signature.user_inputs_to_mutate.values())
    made = sum(
        _attention(graph, sdpa, inputs)
        for sdpa in list(graph.find_nodes(op="call_function", target=_SDPA))
    )
    if made:
        graph.eliminate_dead_code()
        graph.lint()
        program.graph_module.recompile()
    return made


# fmt: off
# The kernels' argument lists stay packed: one argument a line would triple their length.
@triton.jit
def _rotated(ptr, cos_ptr, sin_ptr, ROPE: tl.constexpr, HD: tl.constexpr):
    """The HD values at `ptr` in float32, with RoPE as transformers' Llama applies it where ROPE:
    x * cos + rotate_half(x) * sin."""
    d = tl.arange(0, HD)
    x = tl.load(ptr + d).to(tl.float32)
    if ROPE:
        partner = tl.load(ptr + (d + HD // 2) % HD).to(tl.float32)
        cos = tl.load(cos_ptr + d).to(tl.float32)
        sin = tl.load(sin_ptr + d).to(tl.float32)
        x = x * cos + tl.where(d < HD // 2, -partner, partner) * sin
    return x


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, mask_ptr,
                      pos_ptr, out_ptr, part_ptr, stats_ptr, scale, cache_head_stride,
                      cache_slot_stride, GROUP: tl.constexpr, HD: tl.constexpr, S: tl.constexpr,
                      NSPLIT: tl.constexpr, BS: tl.constexpr, ROPE: tl.constexpr):
    """Program (head, split): the split's slots that the mask lets through, softmax-weighted,
    the new token's key and value at slot `pos` taken from registers (the programs of a key's
    first query head write them into the cache); unnormalized, with their largest score and
    their weights' sum, for `_combine_kernel`."""
    head = tl.program_id(0)
    split = tl.program_id(1)
    heads = tl.num_programs(0)
    kv = head // GROUP
    d = tl.arange(0, HD)
    pos = tl.load(pos_ptr)
    q = (_rotated(q_ptr + head * HD, cos_ptr, sin_ptr, ROPE, HD) * scale).to(tl.float32)
    new_k = _rotated(k_ptr + kv * HD, cos_ptr, sin_ptr, ROPE, HD)
    new_k = new_k.to(k_cache_ptr.dtype.element_ty)
    new_v = tl.load(v_ptr + kv * HD + d).to(v_cache_ptr.dtype.element_ty)
    per_split: tl.constexpr = S // NSPLIT
    cache = kv * cache_head_stride + d[None, :]
    owner = (d >= 0) & (head % GROUP == 0) & (pos // per_split == split)
    tl.store(k_cache_ptr + kv * cache_head_stride + pos * cache_slot_stride + d, new_k, mask=owner)
    tl.store(v_cache_ptr + kv * cache_head_stride + pos * cache_slot_stride + d, new_v, mask=owner)
    top = float("-inf")
    total = 0.0
    acc = tl.zeros([HD], tl.float32)
    end = (split + 1) * per_split
    for start in range(split * per_split, end, BS):
        slots = start + tl.arange(0, BS)
        live = tl.load(mask_ptr + slots, mask=slots < end, other=0) != 0
        old = (live & (slots != pos))[:, None]
        where = cache + slots[:, None] * cache_slot_stride
        k = tl.load(k_cache_ptr + where, mask=old, other=0.0)
        v = tl.load(v_cache_ptr + where, mask=old, other=0.0)
        is_new = (slots == pos)[:, None]
        k = tl.where(is_new, new_k[None, :], k).to(tl.float32)
        v = tl.where(is_new, new_v[None, :], v).to(tl.float32)
        scores = tl.where(live, tl.sum(k * q[None, :], 1), float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 0))
        # While every slot so far is masked, the top is -inf, and exp(-inf - -inf) is nan.
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp(scores - base)
        kept = tl.exp(top - base)
        total = total * kept + tl.sum(p, 0)
        acc = acc * kept + tl.sum(p[:, None] * v, 0)
        top = new_top
    if NSPLIT == 1:
        tl.store(out_ptr + head * HD + d, (acc / total).to(out_ptr.dtype.element_ty))
    else:
        tl.store(part_ptr + (split * heads + head) * HD + d, acc)
        tl.store(stats_ptr + split * heads + head, top)
        tl.store(stats_ptr + (NSPLIT + split) * heads + head, total)


@triton.jit
def _combine_kernel(part_ptr, stats_ptr, out_ptr, HD: tl.constexpr, NSPLIT: tl.constexpr):
    """A head's output from its splits' partial sums, each weighted by exp(its top - the top)."""
    head = tl.program_id(0)
    heads = tl.num_programs(0)
    d = tl.arange(0, HD)
    splits = tl.arange(0, NSPLIT)[:, None]
    tops = tl.load(stats_ptr + splits * heads + head)
    totals = tl.load(stats_ptr + (NSPLIT + splits) * heads + head)
    parts = tl.load(part_ptr + (splits * heads + head) * HD + d[None, :])
    top = tl.max(tops, 0)
    weights = tl.exp(tops - tl.where(top == float("-inf"), 0.0, top)[None, :])
    out = tl.sum(weights * parts, 0) / tl.sum(weights * totals, 0)
    tl.store(out_ptr + head * HD + d, out.to(out_ptr.dtype.element_ty))
# fmt: on


@triton_op("exporter::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
    sin: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
    mask: torch.Tensor, pos: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """One token's attention, as SDPA computes it over the cache after index_copy_ wrote k and v
    at `pos`, which this writes too: q, k and v hold the token's heads one after another (q
    [1, heads, 1, head_dim] or any shape of those values, k and v kv_heads of them), RoPE applied
    here where cos and sin are given (head_dim values each), the caches [1, kv_heads, slots,
    head_dim], mask the slots' bools (what may be attended), pos the slot (one value). Returns
    [1, heads, 1, head_dim], as SDPA."""
    # Every tensor goes to the kernel as given: a view made here would be a copy made by
    # Inductor, a kernel launched at every call.
    q, k, v, mask = (t.contiguous() for t in (q, k, v, mask))
    cos, sin = (None if t is None else t.contiguous() for t in (cos, sin))
    kv_heads, slots, head_dim = k_cache.shape[1:]
    heads = q.numel() // head_dim
    splits = SLOT_SPLITS if slots % (SLOT_SPLITS * SLOT_BLOCK) == 0 else 1
    out = q.new_empty((1, heads, 1, head_dim))
    parts = q.new_empty((splits, heads, head_dim), dtype=torch.float32)
    stats = q.new_empty((2, splits, heads), dtype=torch.float32)
    block = min(SLOT_BLOCK, triton.next_power_of_2(slots // splits))
    wrap_triton(_attention_kernel)[(heads, splits)](
        q, k, v, cos, sin, k_cache, v_cache, mask, pos, out, parts, stats, scale,
        k_cache.stride(1), k_cache.stride(2), GROUP=heads // kv_heads, HD=head_dim, S=slots,
        NSPLIT=splits, BS=block, ROPE=cos is not None, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        wrap_triton(_combine_kernel)[(heads,)](parts, stats, out, HD=head_dim, NSPLIT=splits)
    return out


# Its output for shapes alone. triton_op's own fake runs the op's body, which under
# Triton's interpreter (the CPU's tests) would launch the kernels on fake tensors.
@decode_attention.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, mask, pos, scale):
    head_dim = k_cache.shape[-1]
    return q.new_empty((1, q.numel() // head_dim, 1, head_dim))


def _is(node: object, *targets: object) -> bool:
    """Whether `node` is a node that calls one of `targets`."""
    return isinstance(node, torch.fx.Node) and node.target in targets


def _attention(graph: torch.fx.Graph, sdpa: torch.fx.Node, inputs: set[str]) -> int:
    """1 where the SDPA node was rewritten into decode_attention, else 0. `inputs`: the names of
    the graph's user inputs that it does not mutate."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, sdpa.args, strict=False))
    args |= sdpa.kwargs
    q, mask = tensor_value(args["query"]), tensor_value(args.get("attn_mask"))
    if (
        q is None
        or mask is None
        or args.get("dropout_p", 0.0) != 0.0
        or args.get("is_causal", False)
        or q.dtype not in DTYPES
        or q.dim() != 4
        or q.shape[0] != 1
        or q.shape[2] != 1
        or q.shape[-1] & (q.shape[-1] - 1)
        or mask.dtype != torch.bool
        or mask.numel() != mask.shape[-1]
    ):
        return 0
    writes = [_cache_write(args[name]) for name in ("key", "value")]
    if None in writes:
        return 0
    (k_cache, pos, k), (v_cache, _, v) = writes
    cache, v_cache_value = tensor_value(k_cache), tensor_value(v_cache)
    if (
        cache.shape[2] != mask.shape[-1]
        or q.shape[1] % cache.shape[1]
        # The kernel reads both caches with the keys' strides.
        or (v_cache_value.shape, v_cache_value.stride()) != (cache.shape, cache.stride())
    ):
        return 0
    q_node, k_node, cos, sin = args["query"], k, None, None
    rotations = _rope(q_node), _rope(k_node)
    if None not in rotations and rotations[0][1:] == rotations[1][1:]:
        (q_node, cos, sin), (k_node, _, _) = rotations
    scale = args.get("scale") or q.shape[-1] ** -0.5
    q_node, k_node, v_node, cos, sin, mask = (
        _unviewed(n) for n in (q_node, k_node, v, cos, sin, args["attn_mask"])
    )
    with Inserting(graph, sdpa) as make:
        call = make(
            torch.ops.exporter.decode_attention.default, q_node, k_node, v_node, cos, sin,
            k_cache, v_cache, mask, _position(pos, inputs), scale,
        )  # fmt: skip
    sdpa.replace_all_uses_with(call)
    # SDPA is tagged nondeterministic (its dropout), so dead-code elimination would keep it.
    graph.erase_node(sdpa)
    for name in ("key", "value"):
        _erase_chain(graph, args[name])
    return 1


def _cache_write(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(cache, pos, new) where `node` reads, through repeat_kv's views only, the cache that
    index_copy_(cache, 2, pos, new) wrote one slot of, and nothing else reads that write."""
    while node.target in _REPEAT_KV and len(node.users) == 1:
        node = node.args[0]
    if node.target is not aten.index_copy_.default or len(node.users) != 1:
        return None
    cache, dim, pos, new = node.args
    values = tensor_value(cache), tensor_value(new), tensor_value(pos)
    if None in values or cache.op != "placeholder":
        return None
    cache_value, new_value, pos_value = values
    if (
        dim not in (2, -2)
        or cache_value.dim() != 4
        or cache_value.shape[0] != 1
        or pos_value.numel() != 1
        or new_value.shape[2] != 1
        or new_value.stride(-1) != 1
        or cache_value.stride(-1) != 1
    ):
        return None
    return cache, pos, new


def _unviewed(node: torch.fx.Node | None) -> torch.fx.Node | None:
    """The node whose values `node` views with them in the same order (through views each of
    which is contiguous, of a contiguous source with as many values): what Inductor hands the
    kernel as it is, where it would copy a view of it into a buffer of its own at every call."""
    value = tensor_value(node)
    if value is None or not value.is_contiguous():
        return node
    while _is(node, *_VIEWS) and isinstance(node.args[0], torch.fx.Node):
        source = tensor_value(node.args[0])
        if source is None or not source.is_contiguous() or source.numel() != value.numel():
            break
        node = node.args[0]
    return node


def _position(node: torch.fx.Node, inputs: set[str]) -> torch.fx.Node:
    """The slot as the graph's input holds it, where `node` computes it from there as
    transformers' static cache does, arange(1) + p, p copied into a buffer of each layer's from
    the input's first value (an input not mutated: `inputs`), through `to`s that keep its dtype
    and device; else `node`. Read from the input, it is one kernel a layer fewer."""
    if not (_is(node, aten.add.Tensor) and _is(node.args[0], aten.arange.default)):
        return node
    if node.args[0].args != (1,) or node.args[0].kwargs.get("dtype", torch.int64) != torch.int64:
        return node
    kind = _dtype_and_device(node)
    value = node.args[1]
    while _is(value, *_SAME_VALUE) and _dtype_and_device(value) == kind:
        value = value.args[1 if value.target is aten.copy_.default else 0]
    if not _is(value, aten.select.int) or value.args[1:] != (0, 0):
        return node
    source = value.args[0]
    if source.op != "placeholder" or source.name not in inputs or _dtype_and_device(source) != kind:
        return node
    return value


def _dtype_and_device(node: torch.fx.Node) -> tuple[torch.dtype, torch.device] | None:
    value = tensor_value(node)
    return None if value is None else (value.dtype, value.device)


def _rope(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(x, cos, sin) where `node` is x * cos + cat(-x2, x1) * sin (x1, x2: x's halves on its
    last dim), as transformers' Llama applies RoPE, cos and sin each of x's last dim in values."""
    if not _is(node, aten.add.Tensor) or len(node.args) != 2:
        return None
    for straight, turned in (node.args, node.args[::-1]):
        if not (_is(straight, aten.mul.Tensor) and _is(turned, aten.mul.Tensor)):
            continue
        for x, cos in (straight.args, straight.args[::-1]):
            for cat, sin in (turned.args, turned.args[::-1]):
                if _rotates_half(cat, x) and _holds(cos, x) and _holds(sin, x):
                    return x, cos, sin
    return None


def _holds(table: object, x: object) -> bool:
    """Whether `table` (cos or sin) has one value for each of x's last dim."""
    values = tensor_value(table)
    return values is not None and values.numel() == tensor_value(x).shape[-1]


def _rotates_half(node: object, x: object) -> bool:
    """Whether `node` is cat(-x2, x1) on x's last dim."""
    if not _is(node, aten.cat.default) or node.args[1:] not in ((-1,), (3,)):
        return False
    parts = node.args[0]
    if len(parts) != 2 or not _is(parts[0], aten.neg.default) or tensor_value(x) is None:
        return False
    half = tensor_value(x).shape[-1] // 2
    return _is_slice(parts[0].args[0], x, half, 2 * half) and _is_slice(parts[1], x, 0, half)


def _is_slice(node: object, x: object, start: int, end: int) -> bool:
    """Whether `node` is x[..., start:end] (an end past x's last dim counts as its length)."""
    if not _is(node, aten.slice.Tensor) or node.args[0] is not x:
        return False
    dim, first, last = [*node.args[1:], None, None, None][:3]
    length = tensor_value(x).shape[-1]
    last = length if last is None else min(last, length)
    return dim in (-1, 3) and first == start and last == end


def _erase_chain(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """The views from an index_copy_ to SDPA's k or v, and that index_copy_, now unread."""
    while not node.users:
        source = node.args[0]
        graph.erase_node(node)
        if node.target is aten.index_copy_.default:
            return
        node = source
