"""Sparsity rules: for each torch operation, the index sets of its outputs from those of its inputs.

NOTE: [Three kinds of rules]
Rules are looked up by the operation's name (``torch.roll``, ``Tensor.roll`` and ``x.roll`` share one),
so the spellings a user writes (functions, methods, operators, ``nn.functional``, modules, which call
``nn.functional``) all land here.

* **structural** (shape ops, indexing, slicing, ``roll``, ``pad``, ``cat``/``stack``, ``tril``, ...):
  every output element is a copy of one input element or a constant. The rule runs the operation
  itself on a float64 tensor of element ids (1-based, 0 for "constant") in place of each
  differentiated argument, and reads the sources off the result. One rule serves dozens of ops and
  cannot disagree with torch about their semantics.
* **elementwise** (arithmetic, activations, ``where``, ``clamp``, ...): output element e depends on
  the union of the broadcast input elements at e.
* **reductions and linear maps** (``sum``, ``softmax``, ``matmul``/``linear`` with dense weights,
  ``conv1d``/``conv2d``): unions over fibres, rows, columns or receptive fields.

For scalar functions the second-order pass also keeps, per tensor, the set of input pairs (i, j)
its Hessian can touch: linear and piecewise-linear ops add none, a product adds A_e x B_e, any
other nonlinearity adds S_e x S_e of its element's set S_e.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from . import sets
from .sets import Index, Rows

if TYPE_CHECKING:
    from .detect import Tracer

Rule = Callable[["Tracer", str, tuple, dict, Any], None]
NO_PAIRS = np.zeros(0, dtype=np.int64)


@dataclass
class Info:
    """What the tracer knows about one tensor: its index sets, Hessian pairs, value dependence."""

    rows: Optional[Rows]  # None: derivative structurally zero (a constant, sign(x), x > 0)
    tainted: bool = True  # the value depends on the input
    pairs: Optional[Index] = field(default_factory=lambda: NO_PAIRS)  # None: dense Hessian


class Unsupported(Exception):
    """An operation no rule covers (the message names it)."""


def _ids(shape: tuple[int, ...], base: int = 0) -> Tensor:
    return torch.arange(base + 1, base + 1 + math.prod(shape), dtype=torch.float64, device="cpu").reshape(shape)


def _src(t: Tensor) -> Index:
    """1-based float ids back to 0-based int64 sources (-1: no source)."""
    return t.detach().reshape(-1).to("cpu", torch.int64).numpy() - 1


def _broadcast_src(shape: tuple[int, ...], to: tuple[int, ...]) -> Index:
    ar = torch.arange(math.prod(shape), dtype=torch.int64, device="cpu").reshape(shape)
    return ar.broadcast_to(to).reshape(-1).numpy()


def _float_out(out: Any) -> list[Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_floating_point()]


# --- structural ---


def structural(tr: "Tracer", name: str, args: tuple, kwargs: dict, out: Any, func: Callable) -> None:
    """Run ``func`` on element ids in place of the differentiated arguments (see the note)."""
    parts: list[Rows] = []
    base = [0]
    tainted_index = [False]

    def sub(a: Any) -> Any:
        if not isinstance(a, Tensor):
            return a
        info = tr.get(a)
        if not a.is_floating_point():
            if info is not None and info.tainted:
                tainted_index[0] = True
            return a.cpu()  # ids live on the CPU
        if info is None or info.rows is None:
            return torch.zeros(a.shape, dtype=torch.float64, device="cpu")
        ids = _ids(tuple(a.shape), base[0])
        parts.append(info.rows)
        base[0] += a.numel()
        return ids

    new_args, new_kwargs = tree_map(sub, (list(args), dict(kwargs)))
    if name == "pad":
        _zero_pad_value(new_args, new_kwargs)
    if name == "masked_fill":
        if len(new_args) > 2:
            new_args[2] = 0.0
        if "value" in new_kwargs:
            new_kwargs["value"] = 0.0
    if tainted_index[0]:
        tr.local(f"{name} with an index computed from the input")
    ids_out = func(*new_args, **new_kwargs)
    combined = _concat(parts)
    pairs = sets.merge_keys([tr.pairs_of(a) for a in _deps(tr, args, kwargs)]) if tr.second else NO_PAIRS
    for o, i in zip(_float_out(out), _float_out(ids_out)):
        tr.put(o, Info(sets.gather(combined, _src(i)), True, pairs))


def _zero_pad_value(args: list, kwargs: dict) -> None:
    if "value" in kwargs:
        kwargs["value"] = 0.0
    elif len(args) > 3:
        args[3] = 0.0


def _concat(parts: list[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return sets.empty(0)
    ptrs, off = [np.zeros(1, dtype=np.int64)], 0
    for p in parts:
        ptrs.append(p.ptr[1:] + off)
        off += p.nnz
    return Rows(np.concatenate(ptrs), np.concatenate([p.idx for p in parts]))


def setitem(tr: "Tracer", name: str, args: tuple, kwargs: dict, out: Any, func: Callable) -> None:
    """``t[idx] = v``: the ids of ``v`` written into those of ``t``, then a gather."""
    target, index, value = args[0], args[1], args[2]
    old = tr.get(target)
    vinfo = tr.get(value) if isinstance(value, Tensor) else None
    parts: list[Rows] = []
    ids_t = torch.zeros(target.shape, dtype=torch.float64, device="cpu")
    if old is not None and old.rows is not None:
        ids_t = _ids(tuple(target.shape))
        parts.append(old.rows)
    base = target.numel() if parts else 0
    ids_v: Any = 0.0
    if vinfo is not None and vinfo.rows is not None:
        ids_v = _ids(tuple(value.shape), base)
        parts.append(vinfo.rows)
    elif isinstance(value, Tensor):
        ids_v = torch.zeros(value.shape, dtype=torch.float64, device="cpu")
    for leaf in tree_flatten(index)[0]:
        if isinstance(leaf, Tensor) and (i := tr.get(leaf)) is not None and i.tainted:
            tr.local("an assignment at an index computed from the input")
    ids_t[tree_map(lambda a: a.cpu() if isinstance(a, Tensor) else a, index)] = ids_v
    pairs = sets.merge_keys([tr.pairs_of(a) for a in (target, value) if isinstance(a, Tensor)
                             and tr.get(a) is not None]) if tr.second else NO_PAIRS
    tr.put(target, Info(sets.gather(_concat(parts), _src(ids_t)), True, pairs))


# --- elementwise ---

LINEAR = {"add", "sub", "subtract", "neg", "negative", "positive", "to", "float", "double", "half",
          "bfloat16", "type", "type_as", "clone", "contiguous", "dropout", "nan_to_num", "real"}
PIECEWISE_LINEAR = {"relu", "relu6", "abs", "absolute", "clamp", "clip", "clamp_min", "clamp_max",
                    "maximum", "minimum", "fmax", "fmin", "where", "hardtanh", "leaky_relu",
                    "threshold", "hardshrink", "softshrink", "fmod", "remainder", "max", "min"}
PRODUCTS = {"mul", "multiply"}
QUOTIENTS = {"div", "divide", "true_divide"}
NONLINEAR = {
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin", "acos",
    "atan", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "sigmoid", "logit", "erf", "erfc", "erfinv", "sqrt", "rsqrt", "square", "reciprocal", "elu",
    "selu", "celu", "gelu", "silu", "mish", "softplus", "softsign", "hardsigmoid", "hardswish",
    "logsigmoid", "tanhshrink", "pow", "float_power", "lgamma", "digamma", "sinc", "xlogy",
    "atan2", "arctan2", "hypot", "lerp", "addcmul", "addcdiv", "frac", "rdiv", "rpow", "copysign",
}
ELEMENTWISE = LINEAR | PIECEWISE_LINEAR | PRODUCTS | QUOTIENTS | NONLINEAR


def _deps(tr: "Tracer", args: tuple, kwargs: dict) -> list[Tensor]:
    leaves = tree_flatten((args, kwargs))[0]
    return [a for a in leaves if isinstance(a, Tensor) and a.is_floating_point()
            and (i := tr.get(a)) is not None and i.rows is not None]


def elementwise(tr: "Tracer", name: str, args: tuple, kwargs: dict, out: Any, func: Callable) -> None:
    """Output element e depends on the union of the (broadcast) input elements at e."""
    outs = _float_out(out)
    if not outs:
        return
    o = outs[0]
    shape = tuple(o.shape)
    deps = _deps(tr, args, kwargs)
    parts = []
    for a in deps:
        rows = tr.rows(a)
        parts.append(rows if tuple(a.shape) == shape else sets.gather(rows, _broadcast_src(tuple(a.shape), shape)))
    rows = sets.union(parts, tr.n) if parts else sets.empty(o.numel())
    pairs: Optional[Index] = NO_PAIRS
    if tr.second:
        own: Optional[Index] = NO_PAIRS
        if name in LINEAR or name in PIECEWISE_LINEAR:
            own = NO_PAIRS
        elif name in PRODUCTS and len(deps) == 2:
            own = sets.pairs_across(parts[0], parts[1], tr.n, tr.cap)
        elif name in PRODUCTS or (name in QUOTIENTS and not _is_dep(tr, args[1] if len(args) > 1 else None)):
            own = NO_PAIRS
        else:
            own = sets.pairs_within(rows, tr.n, tr.cap)
        pairs = sets.merge_keys([own] + [tr.pairs_of(a) for a in deps])
    tr.put(o, Info(rows, True, pairs))


def _is_dep(tr: "Tracer", a: Any) -> bool:
    return isinstance(a, Tensor) and (i := tr.get(a)) is not None and i.rows is not None


# --- reductions and ops along a dimension ---

SUMS = {"sum", "mean", "nansum", "nanmean"}
REDUCTIONS = SUMS | {"prod", "amax", "amin", "logsumexp", "norm", "vector_norm", "std", "var",
                     "max", "min"}
ALONG = {"softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "normalize"}
_DIM_AT = {"norm": 2, "vector_norm": 2, "normalize": 2}


def _dims(name: str, t: Tensor, args: tuple, kwargs: dict) -> tuple[int, ...]:
    dim = kwargs.get("dim", kwargs.get("axis"))
    at = _DIM_AT.get(name, 1)
    if dim is None and len(args) > at and not isinstance(args[at], (bool, torch.dtype)):
        dim = args[at]
    if dim is None:
        return tuple(range(t.dim()))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(d % max(t.dim(), 1) for d in dims) if t.dim() else ()


def fibres(rows: Rows, shape: tuple[int, ...], dims: tuple[int, ...], n: int) -> tuple[Rows, Index]:
    """Union of the sets along ``dims``: one set per fibre (in output order), and each element's fibre."""
    if not shape or not dims:
        m = math.prod(shape)
        return rows, np.arange(m, dtype=np.int64)
    ar = torch.arange(math.prod(shape), dtype=torch.int64, device="cpu").reshape(shape)
    rep = ar.amin(dim=dims, keepdim=True)
    reps = rep.reshape(-1).numpy()
    fibre = np.searchsorted(reps, rep.broadcast_to(shape).reshape(-1).numpy())
    return sets.pull(rows, fibre, np.arange(math.prod(shape), dtype=np.int64), reps.shape[0], n), fibre


def reduction(tr: "Tracer", name: str, args: tuple, kwargs: dict, out: Any, func: Callable) -> None:
    x = args[0]
    if name in ("max", "min") and (len(args) > 1 and isinstance(args[1], Tensor) or
                                   isinstance(kwargs.get("other"), Tensor)):
        return elementwise(tr, name, args, kwargs, out, func)
    outs = _float_out(out)
    dims = _dims(name, x, args, kwargs)
    grouped, fibre = fibres(tr.rows(x), tuple(x.shape), dims, tr.n)
    if name not in REDUCTIONS:
        tr.check_size(int(grouped.lengths()[fibre].sum()), x.numel())
    rows = grouped if name in REDUCTIONS else sets.gather(grouped, fibre)
    pairs: Optional[Index] = NO_PAIRS
    if tr.second:
        nonlin = name not in SUMS and name not in PIECEWISE_LINEAR and name != "cumsum"
        own = sets.pairs_within(grouped, tr.n, tr.cap) if nonlin else NO_PAIRS
        pairs = sets.merge_keys([own, tr.pairs_of(x)])
    tr.put(outs[0], Info(rows, True, pairs))


# --- matmul and linear layers (dense weights) ---


def _matmul_rows(tr: "Tracer", a: Optional[Rows], ashape: tuple, b: Optional[Rows], bshape: tuple,
                 out: Tensor) -> tuple[Rows, Optional[Index]]:
    a2 = ashape if len(ashape) > 1 else (1,) + ashape
    b2 = bshape if len(bshape) > 1 else bshape + (1,)
    full = tuple(torch.broadcast_shapes(a2[:-2], b2[:-2])) + (a2[-2], b2[-1])
    parts = []
    numel = math.prod(full)
    if a is not None:
        ra, _ = fibres(a, a2, (len(a2) - 1,), tr.n)
        ids = torch.arange(ra.m, device="cpu").reshape(a2[:-1] + (1,)).broadcast_to(full).reshape(-1).numpy()
        tr.check_size(int(ra.lengths()[ids].sum()), numel)
        parts.append(sets.gather(ra, ids))
    if b is not None:
        rb, _ = fibres(b, b2, (len(b2) - 2,), tr.n)
        ids = torch.arange(rb.m, device="cpu").reshape(b2[:-2] + (1, b2[-1])).broadcast_to(full).reshape(-1).numpy()
        tr.check_size(int(rb.lengths()[ids].sum()), numel)
        parts.append(sets.gather(rb, ids))
    rows = sets.union(parts, tr.n)
    own: Optional[Index] = NO_PAIRS
    if tr.second and len(parts) == 2:
        own = sets.pairs_across(parts[0], parts[1], tr.n, tr.cap)
    return rows, own


def matmul(tr: "Tracer", name: str, args: tuple, kwargs: dict, out: Any, func: Callable) -> None:
    if name == "rmatmul":
        args = (args[1], args[0])
    bias = None
    if name == "addmm":
        bias, args = args[0], (args[1], args[2])
    a, b = args[0], args[1]
    if name == "linear":
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        w = args[1]
        wt = None
        if _is_dep(tr, w):
            src = torch.arange(w.numel(), device="cpu").reshape(w.shape).t().reshape(-1).numpy()
            wt = sets.gather(tr.rows(w), src)
        rows, own = _matmul_rows(tr, tr.rows(a) if _is_dep(tr, a) else None, tuple(a.shape), wt,
                                 tuple(w.t().shape) if w.dim() == 2 else tuple(w.shape), out)
    else:
        rows, own = _matmul_rows(tr, tr.rows(a) if _is_dep(tr, a) else None, tuple(a.shape),
                                 tr.rows(b) if _is_dep(tr, b) else None, tuple(b.shape), out)
    deps = [t for t in (a, b, bias) if _is_dep(tr, t)]
    if bias is not None and _is_dep(tr, bias):
        rows = sets.union([rows, sets.gather(tr.rows(bias), _broadcast_src(tuple(bias.shape), tuple(out.shape)))], tr.n)
    pairs = sets.merge_keys([own] + [tr.pairs_of(t) for t in deps]) if tr.second else NO_PAIRS
    tr.put(out, Info(rows, True, pairs))


# --- convolution (constant weights) ---


def _tuple(v: Any, k: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * k


def conv(tr: "Tracer", name: str, args: tuple, kwargs: dict, out: Any, func: Callable) -> None:
    """Output (b, o, p) depends on the receptive field of p in the input channels of o's group."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    got = dict(zip(names, args)) | kwargs
    x, w = got["input"], got["weight"]
    if _is_dep(tr, w) or _is_dep(tr, got.get("bias")):
        raise Unsupported(f"{name} with weights that depend on the input")
    k = 1 if name == "conv1d" else 2
    unbatched = x.dim() == k + 1
    ids = _ids(tuple(x.shape))
    if unbatched:
        ids = ids.unsqueeze(0)
    if k == 1:
        ids = ids.unsqueeze(2)
    kernel = (1,) * (2 - k) + tuple(w.shape[2:])
    stride = (1,) * (2 - k) + _tuple(got.get("stride", 1), k)
    dilation = (1,) * (2 - k) + _tuple(got.get("dilation", 1), k)
    padding = got.get("padding", 0)
    if isinstance(padding, str):
        if padding == "valid":
            pads = (0, 0) * 2
        else:  # "same" (stride 1): total d (k - 1), the extra element on the right, as torch does
            tot = [d * (s - 1) for d, s in zip(dilation, kernel)]
            pads = (tot[1] // 2, tot[1] - tot[1] // 2, tot[0] // 2, tot[0] - tot[0] // 2)
    else:
        p = (0,) * (2 - k) + _tuple(padding, k)
        pads = (p[1], p[1], p[0], p[0])
    unf = F.unfold(F.pad(ids, pads), kernel, dilation=dilation, stride=stride)  # (B, C*kh*kw, L)
    groups = int(got.get("groups", 1))
    bsz, _, length = unf.shape
    unf = unf.reshape(bsz, groups, -1, length)
    dst = torch.arange(bsz * groups * length, device="cpu").reshape(bsz, groups, 1, length).expand_as(unf)
    src_ids = _src(unf)
    keep = src_ids >= 0
    grouped = sets.pull(tr.rows(x), dst.reshape(-1).numpy()[keep], src_ids[keep], bsz * groups * length, tr.n)
    o_per_group = w.shape[0] // groups
    gid = (torch.arange(bsz * groups * length, device="cpu").reshape(bsz, groups, 1, length)
           .expand(bsz, groups, o_per_group, length).reshape(-1).numpy())
    pairs = tr.pairs_of(x) if tr.second else NO_PAIRS
    tr.put(out, Info(sets.gather(grouped, gid), True, pairs))


STRUCTURAL = {
    "getitem", "reshape", "view", "view_as", "flatten", "unflatten", "squeeze", "unsqueeze",
    "permute", "transpose", "swapaxes", "swapdims", "t", "T", "mT", "expand", "expand_as",
    "broadcast_to", "repeat", "tile", "flip", "fliplr", "flipud", "roll", "narrow", "select",
    "index_select", "gather", "take", "take_along_dim", "cat", "concat", "concatenate", "stack",
    "hstack", "vstack", "dstack", "chunk", "split", "tensor_split", "unbind", "movedim", "moveaxis",
    "pad", "diagonal", "diag", "diag_embed", "tril", "triu", "masked_fill", "repeat_interleave",
    "ravel", "atleast_1d", "atleast_2d", "atleast_3d", "rot90", "unfold", "narrow_copy",
    "split_with_sizes", "squeeze_", "unsqueeze_", "view_as_real",
}

RULES: dict[str, Callable[..., None]] = {}
RULES.update({n: structural for n in STRUCTURAL})
RULES.update({n: elementwise for n in ELEMENTWISE})
RULES.update({n: reduction for n in REDUCTIONS | ALONG})
RULES.update({n: matmul for n in ("matmul", "mm", "bmm", "mv", "dot", "rmatmul", "linear", "addmm")})
RULES.update({"conv1d": conv, "conv2d": conv, "setitem": setitem})

# Ops whose output has a structurally zero derivative, and ops whose output does not depend on
# the values at all (only on shapes).
ZERO_DERIVATIVE = {"sign", "sgn", "floor", "ceil", "round", "trunc", "heaviside", "detach", "data",
                   "argmax", "argmin", "argsort", "floor_divide"}
CONSTANT = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
            "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "randint_like"}
# Python branching on a value computed from x, or a shape that depends on values: local patterns.
BRANCHES = {"py_bool", "py_index", "equal", "allclose", "nonzero", "masked_select", "unique",
            "unique_consecutive", "argwhere", "bincount"}
# A value with a derivative leaving the graph as a Python number: no pattern can follow it.
VALUE_READS = {"item", "tolist", "py_float", "py_int", "py_complex", "numpy", "py_array"}
RANDOM = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
          "rand_like", "randn_like", "randint_like", "bernoulli", "normal", "rand", "randn",
          "multinomial", "uniform", "rrelu"}
