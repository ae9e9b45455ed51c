"""Public entry points of sparse differentiation: sparsity, coloring, sparse_jacobian, sparse_hessian.

NOTE: [Choosing the mode by colours]
Forward mode pushes one jvp per column colour, reverse mode one vjp per row colour; a vjp pass
records a tape and costs about ``REVERSE_COST`` jvp passes here (as in the dense cost model, see
``_planning/plan.py``). ``mode="auto"`` colours both ways and keeps the cheaper: for a function
with a few dense rows (a sum of every input next to local terms) rows need few colours and columns
many, and the reverse for a few dense columns. With both (an arrowhead) it also tries a
bidirectional colouring (see the note in ``coloring.py``: dense rows from vjps, the rest from
jvps, or the mirror image) and keeps it only when it costs less than both sides.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch import Tensor

from .. import _guard
from .. import _checks
from .._cache import Field, register
from .._guard import memo
from .._errors import JacmodeWarning
from .._planning import memory as _memory
from .._planning.memory import fmt_bytes
from .._planning.plan import Plan
from .._state import preserved_state
from .._transforms import in_transform
from . import detect as _detect
from . import evaluate
from .coloring import Coloring, bidirectional, color, cost
from .pattern import SparsityPattern

Fn = Callable[[Tensor], Tensor]
Memory = Optional[Union[int, float, str]]
AUTO_MIN_N = 4096  # structure="auto" looks for sparsity from this many inputs on
AUTO_GAIN = 8  # ... and uses it when it needs at least this many times fewer passes
TIE = 2.0  # colourings this close in cost are timed (see _timed)
SPARSE_WHY = ("its pattern detection runs f on index sets and reads values, and torch.func transforms do "
              "not carry sparse tensors")
DENSE_INSTEAD = ("inside a transform, use the dense jm.jacobian(f, x, batched=False) (or jm.hessian), which "
                 "follows the transform.")

_COLORINGS: "weakref.WeakKeyDictionary[SparsityPattern, dict[tuple, Coloring]]" = register(
    weakref.WeakKeyDictionary(), "sparse colourings")
_VERIFIED: "weakref.WeakSet[Coloring]" = register(weakref.WeakSet(), "sparse colourings checked")


@_guard.entry()
def sparsity(f: Fn, x: Tensor, *, hessian: bool = False) -> SparsityPattern:
    """The sparsity pattern of the Jacobian of ``f`` at ``x`` (or of the Hessian of a scalar ``f``).

    Detection runs ``f`` once with index sets in place of derivatives (see docs/sparse.md): the
    pattern is "global" (valid for every input of this shape and dtype, cached per function and
    signature) unless ``f`` reads values it computed from ``x`` ("local"); when an operation
    cannot be handled at all, the nonzeros of the dense Jacobian at ``x`` are used ("dense", with
    a ``JacmodeWarning``).

    Args:
        f: a function or ``nn.Module`` mapping x (any shape, N elements) to y (Y elements).
        x: one point.
        hessian: the pattern of the Hessian (N, N) of a scalar f instead.

    Returns:
        A :class:`SparsityPattern` of shape (Y, N), or (N, N) with ``hessian=True``.

    Example:
        >>> import torch, jacmode as jm
        >>> f = lambda x: x[1:] - x[:-1]            # forward differences
        >>> p = jm.sparsity(f, torch.zeros(5))
        >>> p.shape, p.nnz, p.scope
        ((4, 5), 8, 'global')
        >>> p.to_dense().int()
        tensor([[1, 1, 0, 0, 0],
                [0, 1, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    _checks.check_function(f)
    _checks.check_outside_transforms("sparsity", "its detection runs f on index sets and reads values",
                                     "the pattern depends on f alone, not on the transformed values.")
    _checks.check_input(x, wrt="inputs", batched=False)
    _checks.check_sparse_args(hessian=hessian)
    return _detect.detect(f, x, hessian=hessian)


def coloring(pattern: SparsityPattern, partition: str = "auto", *, order: str = "best") -> Coloring:
    """Partition the columns (forward) or rows (reverse) of ``pattern`` into structurally orthogonal groups.

    Args:
        pattern: from :func:`sparsity`.
        partition: "column" (one jvp per colour), "row" (one vjp per colour), "star" (symmetric
            Hessian patterns: one Hessian-vector product per colour), "bidirectional" (the
            nonzeros of some rows, or of all but some columns, from vjps, the others from jvps;
            see docs/sparse.md), or "auto": star for a Hessian pattern, else the cheapest of
            column, row and bidirectional (see the note in ``api.py``).
        order: greedy vertex order: "natural", "largest_first", "smallest_last", "incidence",
            "fields", or "best" (try all, keep the fewest colours).

    Returns:
        A :class:`Coloring` with the colours, their number and the lower bound.

    Example:
        >>> import torch, jacmode as jm
        >>> p = jm.sparsity(lambda x: x[1:] * x[:-1], torch.zeros(100))
        >>> c = jm.coloring(p, "column")
        >>> c.n_colors, c.lower_bound        # 2 jvps instead of 100
        (2, 2)
        >>> arrow = lambda x: torch.cat([x.sum().reshape(1), x[1:] * x[:-1] + x[0] * x[1:]])
        >>> jm.coloring(jm.sparsity(arrow, torch.zeros(100)))   # a dense row and a dense column
        Coloring(bidirectional, 4 colours (3 jvps + 1 vjps), lower bound 4, order 'natural/natural')
    """
    if not isinstance(pattern, SparsityPattern):
        raise TypeError(f"pattern: expected a SparsityPattern from jm.sparsity(f, x), got "
                        f"{type(pattern).__name__}.")
    _checks.check_sparse_args(pattern=pattern, partition=partition, order=order)
    return _color(pattern, "star" if pattern.symmetric else partition, order)


def _color(p: SparsityPattern, partition: str, order: str = "best") -> Coloring:
    cache = _COLORINGS.setdefault(p, {})
    key = (partition, order)
    if key not in cache:
        other = {"row": "column", "column": "row"}.get(partition)
        if other is not None and (other, order) in cache and _symmetric(p):
            c = cache[(other, order)]  # the same graph: reuse its colours
            cache[key] = Coloring(partition, c.colors, c.n_colors, c.lower_bound, c.order, p)
        elif partition == "auto":
            col, row = _color(p, "column", order), _color(p, "row", order)
            best = col if cost(col) <= cost(row) else row
            both = bidirectional(p, order, beat=cost(best))
            cache[key] = best if both is None else both
        else:
            cache[key] = color(p, partition, order)
    return cache[key]


def _symmetric(p: SparsityPattern) -> bool:
    if p.shape[0] != p.shape[1]:
        return False
    t = p.transpose()
    return bool(np.array_equal(t.crow, p.crow) and np.array_equal(t.col, p.col))


_PARTITION = {"auto": "auto", "autotune": "auto", "forward": "column", "reverse": "row"}


def prepare(f: Fn, x: Tensor, mode: str, pattern: Optional[SparsityPattern],
            coloring_: Optional[Coloring], hessian: bool, layout: str = "csr") -> Coloring:
    """The colouring to evaluate with: the given one, or one of the (given or detected) pattern
    (for a result in ``layout``: the timing of ``mode="auto"`` refuses one that cannot fit)."""
    if coloring_ is not None:
        return coloring_
    p = pattern if pattern is not None else _detect.detect(f, x, hessian=hessian)
    if hessian or _PARTITION[mode] != "auto":
        return _color(p, "star" if hessian else _PARTITION[mode])
    return _timed(f, x, p, layout)


def _timed(f: Fn, x: Tensor, p: SparsityPattern, layout: str = "csr") -> Coloring:
    """mode="auto": the cheapest colouring by colours; the ones within a factor ``TIE`` of it are
    timed, one compressed evaluation each, and the fastest kept (once per pattern: on CPU a vjp
    pass is often cheaper than a jvp pass, whose rules for shape ops are slower under vmap)."""
    cache = _COLORINGS.setdefault(p, {})
    if ("timed",) in cache:
        return cache[("timed",)]
    col, row = _color(p, "column"), _color(p, "row")
    auto = _color(p, "auto")
    candidates = [col, row] + ([auto] if auto.partition == "bidirectional" else [])
    best = min(candidates, key=cost)
    close = [c for c in candidates if cost(c) <= TIE * cost(best)]
    if len(close) > 1 and p.nnz:
        seconds = []
        xd = x.detach()
        for c in close:
            chunk, _ = _chunk(c, x, None, None, layout)
            t0 = time.perf_counter()
            evaluate.values(f, xd, c, chunk, p.out_shape)
            seconds.append(time.perf_counter() - t0)
        best = close[int(np.argmin(seconds))]
    cache[("timed",)] = best
    return best


def result_bytes(p: SparsityPattern, x: Tensor, layout: str = "csr") -> int:
    """The size of the result in ``layout``: the nonzeros and their indices, or the dense matrix."""
    item = x.element_size()
    if layout == "dense":
        return p.shape[0] * p.shape[1] * item
    if layout == "coo":
        return p.nnz * (item + 16)
    return p.nnz * (item + 8) + (p.shape[0] + 1) * 8


def _chunk(c: Coloring, x: Tensor, chunk_size: Optional[int], max_memory: Optional[int],
           layout: str = "csr") -> tuple[int, int]:
    """Colours per vectorised pass, and the workspace budget on top of the result they were chosen for
    (``memory.budget``); a MemoryError, before anything is evaluated, where the result cannot fit."""
    p = c.pattern
    needed = result_bytes(p, x, layout)
    budget = _memory.budget(max_memory, x.device, needed)
    if budget is None:
        raise _memory.too_large(
            needed, x.device, "the result", f"({p.shape[0]}, {p.shape[1]}) {x.dtype}, {layout}, {p.nnz:,} nonzeros",
            "Pass layout='csr' (sparse_jacobian, sparse_hessian) or structure='sparse' (jacobian, hessian), "
            "which keep the nonzeros only." if layout == "dense" else "Differentiate at a smaller x (split it).")
    per = max(2 * p.pass_bytes, 1)
    if chunk_size is not None:
        return max(1, min(chunk_size, max(c.n_colors, 1))), budget
    if max_memory is not None and per > budget:
        raise ValueError(
            f"max_memory: one direction needs about {fmt_bytes(per)} but the budget is "
            f"{fmt_bytes(budget)}. Raise max_memory, or pass chunk_size=1 to force one colour per pass.")
    return max(1, min(max(c.n_colors, 1), budget // per)), budget


def run(f: Fn, x: Tensor, c: Coloring, layout: str, chunk_size: Optional[int],
        max_memory: Optional[int], create_graph: bool) -> Tensor:
    """Evaluate compressed, check once, decompress (inside the caller's state guard)."""
    p = c.pattern
    xin = x if create_graph else x.detach()
    chunk, _ = _chunk(c, x, chunk_size, max_memory, layout)
    vals = evaluate.values(f, xin, c, chunk, p.out_shape)
    if c not in _VERIFIED and not p.random:
        err = evaluate.probe_check(f, x, c, vals)
        if err is not None:
            warnings.warn(
                f"jacmode: the {p.scope} sparsity pattern missed nonzeros of the Jacobian at this "
                f"input (relative error {err:.2g} against an exact product); recomputing from the "
                "dense Jacobian's nonzeros. Please report the function (an operation's rule is wrong).",
                JacmodeWarning, stacklevel=3)
            with warnings.catch_warnings():  # one warning (above) is enough
                warnings.simplefilter("ignore", JacmodeWarning)
                dense = _detect._dense_fallback(f, x, p.symmetric, f"the {p.scope} pattern missed nonzeros")
            c = color(dense, c.partition)
            _VERIFIED.add(c)
            return run(f, x, c, layout, chunk_size, max_memory, create_graph)
        if p.scope == "global":
            _VERIFIED.add(c)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*support is in beta.*")
        return evaluate.layout(p, vals, layout, p.in_shape if p.symmetric else p.out_shape)


def _check_given(x: Tensor, pattern: Optional[SparsityPattern], coloring_: Optional[Coloring],
                 mode: str, hessian: bool) -> None:
    if coloring_ is not None:
        pattern = coloring_.pattern if pattern is None else pattern
        if coloring_.pattern is not pattern:
            raise ValueError("coloring: it colours a different pattern than pattern=; pass one of them, "
                             "or jm.coloring(pattern) of this pattern.")
        want = {"forward": "column", "reverse": "row"}.get(mode)
        if want is not None and coloring_.partition != want:
            raise ValueError(f"mode: {mode!r} needs a {want} colouring, got coloring= with a "
                             f"{coloring_.partition} partition. Pass mode='auto', or colour with "
                             f"jm.coloring(pattern, {want!r}).")
    if pattern is not None:
        _checks.check_sparse_args(pattern=pattern)
        if tuple(pattern.in_shape) != tuple(x.shape) or pattern.symmetric != hessian:
            kind = "a Hessian" if pattern.symmetric else "a Jacobian"
            raise ValueError(
                f"pattern: it is {kind} pattern for inputs of shape {tuple(pattern.in_shape)}, but x has "
                f"shape {tuple(x.shape)}" + (" and a " + ("Hessian" if hessian else "Jacobian") +
                                             " is asked for" if pattern.symmetric != hessian else "")
                + f". Detect it for this call: jm.sparsity(f, x{', hessian=True' if hessian else ''}).")


@_guard.entry()
def sparse_jacobian(
    f: Fn,
    x: Tensor,
    *more: Any,
    mode: str = "auto",
    layout: str = "csr",
    pattern: Optional[SparsityPattern] = None,
    coloring: Optional[Coloring] = None,
    chunk_size: Optional[int] = None,
    max_memory: Memory = None,
    create_graph: bool = False,
) -> Tensor:
    """The Jacobian of ``f`` at one point ``x`` as a sparse matrix, from one jvp (vjp) per colour.

    ``jm.jacobian(f, x, batched=False, structure="sparse")`` calls this with ``layout="csr"``.
    The pattern is detected (:func:`sparsity`, cached) and coloured (:func:`coloring`) unless
    given; each colour group is one direction of one vectorised pass, in chunks that fit
    ``max_memory``. The first evaluation with a colouring is checked against one exact
    Jacobian-vector product.

    Args:
        f: maps x (N elements, any shape) to y (Y elements, any shape).
        x: one point.
        mode: "auto" (the cheapest of column, row and bidirectional colouring), "forward"
            (column colouring, jvps) or "reverse" (row colouring, vjps).
        layout: "csr" (``torch.sparse_csr_tensor``, (Y, N)), "coo" ((Y, N)) or "dense"
            ((*out, *x.shape), as ``jm.jacobian(..., batched=False)`` returns).
        pattern: a pattern from :func:`sparsity` to reuse.
        coloring: a colouring from :func:`coloring` to reuse.
        chunk_size: colours per vectorised pass.
        max_memory: workspace budget on top of the result, in bytes or as "2GB", as in
            :func:`jacmode.jacobian` (docs/memory.md).
        create_graph: keep the values differentiable with respect to x and parameters.

    Returns:
        The Jacobian, (Y, N) sparse (CSR or COO) or (*out, *x.shape) dense.

    Raises:
        MemoryError: the result is larger than the free memory, before anything is evaluated.
        ValueError: not even one colour per pass fits ``max_memory``.

    Example:
        >>> import torch, jacmode as jm
        >>> f = lambda x: torch.sin(x[1:] * x[:-1])
        >>> x = torch.rand(1000, dtype=torch.float64)
        >>> J = jm.sparse_jacobian(f, x)
        >>> J.layout, J.shape, J.values().shape
        (torch.sparse_csr, torch.Size([999, 1000]), torch.Size([1998]))
        >>> torch.allclose(J.to_dense(), torch.func.jacfwd(f)(x))
        True
    """
    _checks.check_function(f)
    _checks.check_outside_transforms("sparse_jacobian", SPARSE_WHY, DENSE_INSTEAD)
    _checks.check_one_argument(more, "sparse_jacobian")
    _checks.check_input(x, wrt="inputs", batched=False)
    opts = _checks.check_options(wrt="inputs", mode=mode, batched=False, structure="sparse",
                                 chunk_size=chunk_size, create_graph=create_graph, flatten=True,
                                 max_memory=max_memory)
    _checks.check_sparse_args(layout=layout, mode=mode)
    _check_given(x, pattern, coloring, mode, hessian=False)
    grad_mode = torch.enable_grad() if opts.create_graph else torch.no_grad()
    with preserved_state(f), grad_mode:
        c = prepare(f, x, mode, pattern, coloring, hessian=False, layout=layout)
        return run(f, x, c, layout, opts.chunk_size, opts.max_memory, opts.create_graph)


@_guard.entry()
def sparse_hessian(
    f: Fn,
    x: Tensor,
    *more: Any,
    layout: str = "csr",
    pattern: Optional[SparsityPattern] = None,
    coloring: Optional[Coloring] = None,
    chunk_size: Optional[int] = None,
    max_memory: Memory = None,
    create_graph: bool = False,
) -> Tensor:
    """The Hessian of a scalar ``f`` at one point ``x``, sparse, from one Hessian-vector product per star colour.

    ``jm.hessian(f, x, structure="sparse")`` calls this. Star colouring uses the symmetry: every
    entry is read either in its row or in its column, which needs fewer colours than colouring the
    columns of the Hessian as a Jacobian.

    Args:
        f: maps x (N elements) to a scalar (shape () or (1,)).
        x: one point.
        layout: "csr" ((N, N)), "coo" ((N, N)) or "dense" ((*x.shape, *x.shape)).
        pattern: a Hessian pattern from ``jm.sparsity(f, x, hessian=True)`` to reuse.
        coloring: a star colouring from :func:`coloring` to reuse.
        chunk_size: colours per vectorised pass.
        max_memory: workspace budget on top of the result, in bytes or as "2GB", as in
            :func:`jacmode.jacobian` (docs/memory.md).
        create_graph: keep the values differentiable.

    Returns:
        The Hessian, (N, N) sparse (CSR or COO) or (*x.shape, *x.shape) dense.

    Raises:
        MemoryError: the result is larger than the free memory, before anything is evaluated.
        ValueError: not even one colour per pass fits ``max_memory``.

    Example:
        >>> import torch, jacmode as jm
        >>> energy = lambda x: ((x[1:] - x[:-1]) ** 2).sum() + (x ** 4).sum()
        >>> x = torch.rand(500, dtype=torch.float64)
        >>> H = jm.sparse_hessian(energy, x)
        >>> H.shape, jm.coloring(jm.sparsity(energy, x, hessian=True)).n_colors   # 3 products, not 500
        (torch.Size([500, 500]), 3)
        >>> torch.allclose(H.to_dense(), torch.func.hessian(energy)(x))
        True
    """
    _checks.check_function(f)
    _checks.check_outside_transforms("sparse_hessian", SPARSE_WHY, DENSE_INSTEAD)
    _checks.check_input(x, wrt="inputs", batched=False)
    _checks.check_one_argument(more, "sparse_hessian")
    opts = _checks.check_options(wrt="inputs", mode="auto", batched=False, structure="sparse",
                                 chunk_size=chunk_size, create_graph=create_graph, flatten=True,
                                 max_memory=max_memory)
    _checks.check_sparse_args(layout=layout)
    _check_given(x, pattern, coloring, "auto", hessian=True)
    if coloring is not None and coloring.partition != "star":
        raise ValueError(f"coloring: a Hessian needs a star colouring, got a {coloring.partition} one. "
                         "Pass jm.coloring(jm.sparsity(f, x, hessian=True)).")
    grad_mode = torch.enable_grad() if opts.create_graph else torch.no_grad()
    with preserved_state(f), grad_mode:
        _check_scalar(f, x)
        c = prepare(f, x, "auto", pattern, coloring, hessian=True, layout=layout)
        return run(f, x, c, layout, opts.chunk_size, opts.max_memory, opts.create_graph)


def _check_scalar(f: Fn, x: Tensor) -> None:
    with torch.no_grad():
        y = f(x.detach())
    if not isinstance(y, Tensor) or y.numel() != 1:
        shape = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise ValueError(f"f: a Hessian needs a scalar function, but f(x) has shape {shape}. Return "
                         "one number (e.g. sum the terms), or use jm.sparse_jacobian for vector outputs.")


def plan(f: Fn, x: Tensor, mode: str, chunk_size: Optional[int], max_memory: Optional[int],
         hessian: bool = False) -> Plan:
    """What a sparse call would do: partition, colours, lower bound, chunk, memory."""
    with preserved_state(f), torch.no_grad():
        c = prepare(f, x, mode, None, None, hessian)
        call_s = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            f(x.detach())
            call_s = min(call_s, time.perf_counter() - t0)
    p = c.pattern
    chunk, budget = _chunk(c, x, chunk_size, max_memory)
    costs = {}
    if not hessian:
        for name, part in (("forward", "column"), ("reverse", "row"), ("bidirectional", "bidirectional")):
            if part == "bidirectional" and c.partition != part:
                continue  # only costed when chosen (or given)
            other = c if c.partition == part else _color(p, part)
            costs[name] = call_s * (1 + 2 * cost(other))
    else:
        costs["forward"] = call_s * (1 + 4 * c.n_colors)
    mode_name = {"row": "reverse", "bidirectional": "bidirectional"}.get(c.partition, "forward")
    what = {"column": "column colouring (one jvp per colour)", "row": "row colouring (one vjp per colour)",
            "star": "star colouring of the Hessian (one Hessian-vector product per colour)",
            "bidirectional": f"bidirectional colouring ({c.n_column_colors} jvps on column colours + "
                             f"{c.n_row_colors} vjps on row colours)"}[c.partition]
    reason = (f"sparse: {what}, {c.n_colors} colours (lower bound {c.lower_bound}, order "
              f"{c.order!r}) for {p.shape[0]:,} x {p.shape[1]:,} with {p.nnz:,} nonzeros; "
              f"{p.scope} pattern" + (f" ({p.reason})" if p.reason else ""))
    return Plan(mode=mode_name, strategy="sparse", directions=c.n_colors, chunk_size=chunk,
                sample_chunk=None, costs=costs, result_bytes=result_bytes(p, x),
                workspace_bytes=chunk * 2 * p.pass_bytes, budget_bytes=budget, reason=reason,
                coloring=c)


# f -> the inputs for which structure="auto" found no sparsity worth using (Memo.declined)
_DECLINED = Field("declined", "sparse auto declined")


def auto(f: Fn, x: Tensor, opts: Any) -> Optional[Coloring]:
    """For ``structure="auto"`` on one large point: a colouring when it clearly beats dense passes.

    Conservative: only global patterns, found without a warning, that need ``AUTO_GAIN`` times
    fewer passes than the dense Jacobian; anything else (including any failure) keeps today's path.
    """
    if opts.batched or opts.wrt != "inputs" or opts.structure != "auto" or x.numel() < AUTO_MIN_N or in_transform():
        return None
    key = _detect._key(f, x, False)
    kept = memo(f)
    if kept is None or key in kept.declined:  # (None: f cannot be weakly referenced)
        return None
    try:
        hit = _detect._PATTERNS.get(f, key)
        if hit is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with preserved_state(f):
                    hit = _detect._trace(f, x, False, max(16, x.numel() // AUTO_GAIN))
        if not isinstance(hit, SparsityPattern) or hit.scope != "global" or hit.random:
            raise LookupError
        _detect._PATTERNS.put(f, key, hit)
        c = _color(hit, _PARTITION.get(opts.mode, "auto"))
        if c.n_colors * AUTO_GAIN > min(hit.shape):
            raise LookupError
        return c
    except Exception:  # noqa: BLE001 -- any failure keeps the dense path
        kept.declined.add(key)
        return None
