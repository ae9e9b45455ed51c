"""Rewrites of generated code (``codegen.py``) that do less work than the traced algebra spells out.

NOTE: [Constant directions through a linear map]
The Taylor algebras seed their directions as rows shared by all samples: coordinate vectors,
columns of a weight, (L, 1, *in). Through the first linear map they stay so, C = (D, 1, H); the
first activation scales them per sample, g[d, b, k] = C[d, k] f[b, k] (``tanh_backward(C, y)``,
``sigmoid_backward(C, y)`` or a product), a (D, B, H) tensor that the next linear map ``W`` (J, H)
reads once: g @ W^T, B D H J multiply-adds, after a pass that wrote D B H numbers. The same
numbers come from one matrix product of the per-sample factor alone with the directions folded
into the weight:

    (g @ W^T)[d, b, j] = sum_k f[b, k] (C[d, k] W[j, k]) = (f @ M)[b, (d, j)],  M = (H, D J),

the same multiply-adds in a better-shaped product (K = H, N = D J), and neither the (D, B, H)
tensor nor its pass exist. The rewrite is exact: only the order of a product of three numbers
differs (rounding). It applies to every algebra whose directions are shared by the samples
(coordinates, a weight's columns), never to per-sample ones, and only where M is smaller than
g (J <= B).

Where the result is read only by a sum of squares over the directions, sum_d (f @ M)[b, d, j]^2
(the forward Laplacian's last hidden layer, L' = s'(h) L + s''(h) sum_d h_d^2, most of its work
for few inputs: the PINN class), the product and the sum run block by block over the samples
(``CHUNK_BYTES`` of product at a time, in cache; at most ``MAX_CHUNKS`` blocks, of one size
where possible, so that compiled code has one kernel for them all): the (B, D, J) result is never
stored whole, neither its pass to memory nor the page faults of a fresh 10 MB buffer per call.
Elsewhere (a deeper network, the Hessian) the result is laid out (B, D, J) and read through a
permuted view as (D, B, J), the views after it become reshapes (a copy only where a later
product needs rows in the other order); only for compiled code, since torch's own reductions
over such a view are slower than the pass saved, where Inductor picks the layouts itself.

NOTE: [Constants and dead code of generated code]
:func:`constants` evaluates once what reads no input (the seeds e_d: ``new_zeros`` then an
``index_put_`` of ones, which read only the dtype and device of the input) and makes it a
buffer of the GraphModule: no kernel for it when compiled (one C++ kernel fewer to build on the
first call), three operations fewer per call when not. It refuses where an input is written
into such a tensor or a read precedes its last write. :func:`dead_code` drops the operations
nothing reads (the first-order coefficients of the output that a Laplacian never returns, a
pass over (D, B, H) and a product): make_fx keeps them, torch.compile drops them itself,
uncompiled code ran them. ``ENABLED`` switches the rewrites (not dead code) off for tests and
benchmarks.

NOTE: [Tanh in compiled code]
Inductor's C++ code evaluates ``tanh`` with a vectorised routine accurate to 1 ulp that costs
about 3.5x an ``exp`` (0.77 ms for 4096 x 64 floats on one thread of the development machine,
against 0.22 ms): a quarter of a compiled forward Laplacian of the PINN class, and most of the
no-grad forward of problem 2's ``net_x``. For compiled code that runs without grad,
:func:`fast_tanh` spells each ``tanh`` out as Cody and Waite's algorithm (Software Manual for the
Elementary Functions, 1980, chapter 17) in elementwise operations that Inductor fuses:
tanh|x| = |x| + |x| R(x^2) below ln(3)/2, with their rational R of degree (1, 1) in single and (2, 3)
in double precision, and 1 - 2 / (exp(2|x|) + 1) above it, the sign copied back. Measured over
4 million points of [-30, 30] and a logarithmic sweep down to the smallest subnormals, the result
is within 1.5 ulp of the exact value in float32 (Inductor's own: 1.0) and within 1 ulp of torch's
tanh in float64; signed zeros, infinities and NaN are kept. About 1.8x faster compiled (0.42 ms
above). Only without grad: the coefficients of the Taylor algebra are computed from the value
(``tanh_backward``), never by differentiating it, whereas under ``create_graph`` autograd would
differentiate the spelled-out form. Only on CPU (CUDA's tanh is one fast instruction sequence).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import Tensor

ENABLED = True  # internal switch: False keeps the traced graph as it is (benchmarks compare the two)
CHUNK_BYTES = 1 << 20  # a blocked sum of squares works on about this much at a time (in cache)
MAX_CHUNKS = 8  # and on at most this many blocks (the size of the graph: 16 cost 30% more compile time)

_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default)
_SCALED = (_aten.mul.Tensor, _aten.tanh_backward.default, _aten.sigmoid_backward.default)


def _val(n: Any) -> Optional[Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, Tensor) else None


def dead_code(graph: fx.Graph) -> bool:
    """Remove the operations whose results nothing reads (pure aten operations only)."""
    changed = False
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None or schema.is_mutable or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        graph.erase_node(node)
        changed = True
    return changed


_FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full"}  # read only the dtype and device of self


def constants(gm: fx.GraphModule) -> bool:
    """Evaluate the operations that read no input once and make their results buffers of gm, in
    place; False where nothing was folded (see [Constants and dead code of generated code])."""
    if not ENABLED:
        return False
    graph = gm.graph
    const: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            const.add(node)
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            continue
        name = node.target.overloadpacket.__name__
        reads = [a for a in (*_nodes(node.args[1:] if name in _FACTORIES else node.args), *_nodes(node.kwargs))]
        if all(a in const for a in reads):
            const.add(node)
        elif node.target._schema.is_mutable and any(_base(a) in const for a in _nodes(node.args)):
            return False  # an input written into a constant: nothing is folded
    frontier = [n for n in graph.nodes if n in const and n.op == "call_function"
                and any(u not in const for u in n.users)]
    if not frontier:
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes = [order[n] for n in const if n.op == "call_function" and getattr(n.target, "_schema").is_mutable]
    uses = [order[u] for n in frontier for u in n.users if u not in const]
    if writes and min(uses) < max(writes):  # a read before the last write: the value differs there
        return False
    env: dict[fx.Node, Any] = {}
    try:
        for node in graph.nodes:
            if node not in const:
                v = _val(node)
                env[node] = None if v is None else torch.empty(0, dtype=v.dtype, device=v.device)
            elif node.op == "get_attr":
                env[node] = getattr(gm, node.target)
            else:
                args = fx.node.map_arg(node.args, lambda a: env[a])
                kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
                env[node] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- an op that cannot run here: keep the graph as it is
        return False
    if not all(isinstance(env[n], Tensor) for n in frontier):  # a tuple of tensors (split): not folded
        return False
    for i, node in enumerate(frontier):
        name = f"_jacmode_constant{i}"
        gm.register_buffer(name, env[node].clone(), persistent=False)
        with graph.inserting_before(node):
            attr = graph.get_attr(name)
        attr.meta = dict(node.meta)
        for u in [u for u in node.users if u not in const]:
            u.replace_input_with(node, attr)
    for node in reversed(list(graph.nodes)):  # the folded operations, their writes included
        if node in const and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return True


def _nodes(a: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(a, out.append)
    return out


def _base(n: fx.Node) -> fx.Node:
    """The node whose storage a chain of views of n reads."""
    while n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and _is_view(n):
        n = n.args[0]
    return n


def _is_view(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None \
        and not schema.returns[0].alias_info.is_write


def _split(g: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(C, y) of g = scale(C, y) with C (D, 1, H) shared by the samples and y (1, B, H) or (B, H)."""
    if g.op != "call_function" or g.target not in _SCALED or g.kwargs or len(g.args) != 2:
        return None
    pairs = [(g.args[0], g.args[1])]
    if g.target is _aten.mul.Tensor:
        pairs.append((g.args[1], g.args[0]))
    gv = _val(g)
    if gv is None or gv.dim() != 3:
        return None
    d, b, h = gv.shape
    for c, y in pairs:
        cv, yv = _val(c), _val(y)
        if cv is None or yv is None or cv.dtype != gv.dtype or yv.dtype != gv.dtype:
            continue
        if tuple(cv.shape) == (d, 1, h) and tuple(yv.shape) in ((1, b, h), (b, h)) and d > 1 and b > 1:
            return c, y  # type: ignore[return-value]
    return None


def _folded(graph: fx.Graph, g: fx.Node, c: fx.Node, y: fx.Node, w: fx.Node) -> tuple[fx.Node, fx.Node]:
    """f (B, H) and M (H, D J) of the note, for g = scale(C, y) and the weight w (H, J)."""
    d, b, h = _val(g).shape  # type: ignore[union-attr]
    j = _val(w).shape[1]  # type: ignore[union-attr]
    call = graph.call_function
    if g.target is _aten.mul.Tensor:
        f = y
    elif g.target is _aten.tanh_backward.default:  # C (1 - y^2)
        f = call(_aten.rsub.Scalar, (call(_aten.mul.Tensor, (y, y)), 1))
    else:  # sigmoid_backward: C y (1 - y)
        f = call(_aten.mul.Tensor, (y, call(_aten.rsub.Scalar, (y, 1))))
    # M^T (D J, H) in rows, read transposed: MKL's NT product is ~8% faster than NN at these shapes
    wt = call(_aten.unsqueeze.default, (call(_aten.permute.default, (w, [1, 0])), 0))  # (1, J, H)
    m = call(_aten.mul.Tensor, (call(_aten.reshape.default, (c, [d, 1, h])), wt))  # (D, J, H)
    m = call(_aten.clone.default, (m,), {"memory_format": torch.contiguous_format})
    m = call(_aten.permute.default, (call(_aten.view.default, (m, [d * j, h])), [1, 0]))  # (H, D J)
    return call(_aten.reshape.default, (f, [b, h])), m


def _square_sums(views: list[fx.Node]) -> Optional[list[fx.Node]]:
    """The nodes sum(v * v, [0], keepdim=True) that are all the uses of the (D, B, J) ``views``."""
    sums = []
    for v in views:
        for u in v.users:
            if not (u.op == "call_function" and u.target is _aten.mul.Tensor and not u.kwargs
                    and len(u.args) == 2 and u.args[0] is v and u.args[1] is v):
                return None
            for s in u.users:
                if not (s.op == "call_function" and s.target is _aten.sum.dim_IntList and not s.kwargs
                        and len(s.args) == 3 and s.args[1] in ([0], (0,)) and s.args[2] is True):
                    return None
                sums.append(s)
    return sums


def _rows(b: int, row_bytes: int) -> int:
    """Samples per block of a blocked square sum: blocks of about CHUNK_BYTES, at most MAX_CHUNKS,
    all of one size where a count near that divides B (one kernel for all blocks when compiled)."""
    n = min(MAX_CHUNKS, max(1, -(-b * row_bytes // CHUNK_BYTES)))
    even = next((k for k in range(n, min(2 * n, MAX_CHUNKS) + 1) if b % k == 0), n)
    return -(-b // even)


def _square_sum(graph: fx.Graph, f: fx.Node, m: fx.Node, d: int, b: int, j: int, itemsize: int,
                in_place: bool) -> fx.Node:
    """(1, B, J): sum over d of (f @ M)[:, d, :]^2, block by block over the samples; ``in_place``
    squares each block's fresh product in place (code without grad)."""
    call = graph.call_function
    rows = _rows(b, d * j * itemsize)
    parts = []
    for s in range(0, b, rows):
        e = min(b, s + rows)
        o = call(_aten.mm.default, (call(_aten.slice.Tensor, (f, 0, s, e)) if rows < b else f, m))
        o = call(_aten.view.default, (o, [e - s, d, j]))
        square = _aten.mul_.Tensor if in_place else _aten.mul.Tensor
        parts.append(call(_aten.sum.dim_IntList, (call(square, (o, o)), [1])))
    total = parts[0] if len(parts) == 1 else call(_aten.cat.default, (parts, 0))
    return call(_aten.unsqueeze.default, (total, 0))


def constant_directions(gm: fx.GraphModule, compiled: bool = False, in_place: bool = False) -> Optional[fx.GraphModule]:
    """gm with [Constant directions through a linear map] applied, or None where nothing applies
    (or the rewritten graph could not be checked with fake tensors): blocked where the result
    feeds only a sum of squares, permuted only for ``compiled`` code (see the note); ``in_place``
    for code that runs without grad."""
    if not ENABLED:
        return None
    new = copy.deepcopy(gm)
    graph = new.graph
    dead_code(graph)  # the dead reads of a result would hide that a sum of squares is its only use
    outs: list[fx.Node] = []
    done = False
    for mm in list(graph.nodes):
        if mm.op != "call_function" or mm.target is not _aten.mm.default or len(mm.args) != 2:
            continue
        a, w = mm.args
        if not (isinstance(a, fx.Node) and isinstance(w, fx.Node) and a.op == "call_function"
                and a.target in _VIEWS and len(a.users) == 1 and isinstance(a.args[0], fx.Node)):
            continue
        g = a.args[0]
        split = _split(g) if len(g.users) == 1 else None
        gv, wv = _val(g), _val(w)
        if split is None or gv is None or wv is None or wv.dim() != 2 or wv.dtype != gv.dtype:
            continue
        d, b, h = gv.shape
        j = wv.shape[1]
        if wv.shape[0] != h or tuple(_val(a).shape) != (d * b, h) or h * j > b * h:  # type: ignore[union-attr]
            continue
        views = list(mm.users)
        if not views or not all(u.op == "call_function" and u.target in _VIEWS and _val(u) is not None
                                and tuple(_val(u).shape) == (d, b, j) for u in views):  # type: ignore[union-attr]
            continue
        sums = _square_sums(views)
        if sums is None and not compiled:
            continue
        with graph.inserting_before(mm):
            f, m = _folded(graph, g, split[0], split[1], w)
            if sums is not None:
                total = _square_sum(graph, f, m, d, b, j, gv.element_size(), in_place and not compiled)
            else:
                out = graph.call_function(_aten.mm.default, (f, m))
                out = graph.call_function(_aten.permute.default, (
                    graph.call_function(_aten.view.default, (out, [b, d, j])), [1, 0, 2]))
        if sums is not None:
            for s in sums:
                s.replace_all_uses_with(total)
                sq = s.args[0]
                graph.erase_node(s)
                if isinstance(sq, fx.Node) and not sq.users:
                    graph.erase_node(sq)
        else:
            for u in views:
                u.replace_all_uses_with(out)
            outs.append(out)
        for n in (*views, mm, a, g):
            graph.erase_node(n)
        done = True
    if not done:
        return None
    for node in _after(outs):  # the views after a permuted result: reshapes (a copy only where needed)
        if node.op == "call_function" and node.target in (_aten.view.default, _aten._unsafe_view.default):
            node.target = _aten.reshape.default
    dead_code(graph)
    graph.lint()
    new.recompile()
    return new if _propagate(new) else None


def _after(nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes that read any of ``nodes``, directly or not."""
    seen: dict[fx.Node, None] = {}
    todo = list(nodes)
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen[u] = None
                todo.append(u)
    return list(seen)


def _propagate(gm: fx.GraphModule) -> bool:
    """Fresh fake-tensor metadata (shapes, strides) for every node; False where that fails."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in inputs if isinstance(v, Tensor)])
    if mode is None or not all(isinstance(v, Tensor) for v in inputs):
        return False
    fake = mode

    class _Prop(FakeTensorProp):
        def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:  # constants: fake ones
            value = super().get_attr(target, args, kwargs)
            return fake.from_tensor(value) if isinstance(value, Tensor) else value

    try:
        _Prop(gm, mode).propagate_dont_convert_inputs(*inputs)
    except Exception:  # noqa: BLE001 -- an op that fake tensors cannot run: keep the traced graph
        return False
    return True


_TANH_K = 0.54930614433405484570  # ln(3) / 2, where Cody and Waite switch from R to exp
# Cody and Waite's coefficients: numerator p(g) and denominator q(g) of tanh|x| = |x| + |x| p(g) / q(g), g = x^2
_TANH_P = {torch.float32: (-0.8237728127, -0.3831010665e-2),
           torch.float64: (-0.16134119023996228053e4, -0.99225929672236083313e2, -0.96437492777225469787)}
_TANH_Q = {torch.float32: (2.471319654, 1.0),
           torch.float64: (0.48402357071988688686e4, 0.22337720718962312926e4, 0.11274474380534949335e3, 1.0)}
_TANH_ONE = {torch.float32: 9.1, torch.float64: 19.1}  # tanh rounds to 1 beyond these


def tanh_spelled(x: Any, dtype: Optional[torch.dtype] = None, call: Any = None) -> Any:
    """tanh(x) by Cody and Waite's algorithm in elementwise aten operations (see [Tanh in compiled
    code]), x float32 or float64 (``dtype``: x's, given where x is a graph node); ``call(op, args)``
    makes each operation (default: runs it).

    Example:
        >>> x = torch.linspace(-3, 3, 7)
        >>> bool((tanh_spelled(x) - torch.tanh(x)).abs().max() < 1e-6)
        True
    """
    op = call or (lambda target, args: target(*args))
    dtype = dtype or x.dtype

    def poly(g: Any, coefs: tuple[float, ...]) -> Any:  # coefs[0] + coefs[1] g + ..., by Horner
        acc: Any = coefs[-1]
        for c in reversed(coefs[:-1]):
            acc = op(_aten.add.Tensor, (op(_aten.mul.Tensor, (g, acc)), c))
        return acc

    f = op(_aten.abs.default, (x,))
    g = op(_aten.mul.Tensor, (f, f))
    p = op(_aten.mul.Tensor, (poly(g, _TANH_P[dtype]), g))
    small = op(_aten.add.Tensor, (f, op(_aten.mul.Tensor, (f, op(_aten.div.Tensor, (p, poly(g, _TANH_Q[dtype])))))))
    e = op(_aten.exp.default, (op(_aten.mul.Tensor, (op(_aten.clamp_max.default, (f, _TANH_ONE[dtype])), 2.0)),))
    big = op(_aten.rsub.Scalar, (op(_aten.div.Tensor, (op(_aten.reciprocal.default, (op(_aten.add.Tensor, (e, 1.0)),)), 0.5)), 1.0))
    pick = op(_aten.gt.Scalar, (f, _TANH_K))
    return op(_aten.copysign.Tensor, (op(_aten.where.self, (pick, big, small)), x))


def fast_tanh(gm: fx.GraphModule) -> bool:
    """Replace each float32/float64 CPU ``tanh`` of gm by :func:`tanh_spelled`, in place; False
    where there is none (see [Tanh in compiled code]: for compiled code that runs without grad)."""
    if not ENABLED:
        return False
    graph, done = gm.graph, False
    for node in list(graph.nodes):
        v = _val(node)
        if (node.op != "call_function" or node.target is not _aten.tanh.default or v is None
                or v.dtype not in _TANH_P or v.device.type != "cpu"):
            continue
        with graph.inserting_before(node):
            new = tanh_spelled(node.args[0], v.dtype, lambda target, args: graph.call_function(target, tuple(args)))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done = True
    if done:
        graph.lint()
        gm.recompile()
    return done


def work(gm: fx.GraphModule) -> int:
    """Multiply-adds of the matrix products of gm (for tests and benchmarks)."""
    total = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (_aten.mm.default, _aten.addmm.default):
            a, b = (_val(x) for x in n.args[-2:])
            if a is not None and b is not None:
                total += math.prod(a.shape) * b.shape[-1]
    return total
