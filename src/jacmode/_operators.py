"""Linear differential operators: any weighted sum of mixed partials, collapsed, exact or estimated.

``operator(f, x, terms)`` computes L u = sum_k c_k D^(|a_k|) u [v_(a_k)] per sample, where a term
(c_k, a_k) names the coordinates (or the rows of ``directions``) to differentiate along and c_k is
a number, one number per sample (B,), or a tensor (1 | B, *out) weighting the output components.
On the Taylor path it runs collapsed (``_capture/collapsed.py``): the highest-order coefficients
are summed as they are formed, so the pass carries one coefficient per distinct lower-order
sub-multiset of the terms, not one per term; on the generic path every term is nested forward
mode (``_autodiff/directional.py``), exact for any f. The Laplacian, the weighted Laplacian
tr(S S^T Hess u), the biharmonic operator and the divergence are instances.

NOTE: [Randomised estimators]
For random v with E[v v^T] = I (Rademacher or standard Gaussian), E[v^T H v] = tr(H): the
Laplacian is the mean of K directional second derivatives (Hutchinson), and with v = S xi,
E[v v^T] = S S^T, the weighted Laplacian. For the biharmonic operator, a standard Gaussian v gives
E[D^4 u[v, v, v, v]] = 3 sum_(i,j) u_iijj (Isserlis), so D^4 u[v]^4 / 3 is unbiased (the
stochastic Taylor derivative estimator, STDE); Rademacher directions are not (E[v_i^4] = 1, not 3).
Each sample draws its own K directions, so the errors of different samples are independent. The
spread reported is the standard error of the mean over the K draws, from their unbiased variance;
asking for it keeps the K second-order coefficients apart instead of summing them (about 1.5x).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _guard
from . import _args, _checks
from ._args import Argnums, InDims
from ._checks import Options
from ._capture import collapsed as _collapsed
from ._autodiff import directional as _directional
from ._capture.taylor import Key, _sub_keys
from ._operands import SUM_PASS_BYTES, Target, direction_chunks, evaluate, missing_derivative, validated
from ._problem import captured
from ._rules import decompositions

Fn = Callable[[Tensor], Tensor]
Result = Union[Tensor, tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class OperatorPlan:
    """How :func:`operator` would compute a linear differential operator.

    Attributes:
        engine: "collapsed Taylor mode" (the captured graph) or "nested forward mode" (any f).
        terms: distinct terms after merging equal ones.
        order: the highest derivative order.
        directions: first-order directions carried (coordinates or rows of ``directions``).
        coefficients: Taylor coefficients carried per pass besides the value (collapsed: one per
            distinct lower-order sub-multiset, plus one for the summed top order); for nested
            forward mode, the jvp chains (one per term).
        passes: about how many forward passes the call costs (collapsed: coefficients + 1;
            nested: sum over terms of 2^order).
        why: why this engine.
    """

    engine: str
    terms: int
    order: int
    directions: int
    coefficients: int
    passes: int
    why: str


@dataclass
class _Terms:
    """Terms normalised: collapsible ones (number or (1, B) weights), read-outs, and the value."""

    collapsed: list[tuple[Union[float, Tensor], Key]]
    read: list[tuple[Tensor, Key]]  # weights (1 | B, *out) that depend on the output component
    directions: Optional[Tensor]  # (M, 1 | B, N) or None for coordinates

    def all(self) -> list[tuple[Any, Key]]:
        return [*self.collapsed, *self.read]

    def diagonal(self) -> bool:
        """Only terms D^2 u[v_r, v_r]: the vectorised forward Laplacian serves them."""
        return not self.read and bool(self.collapsed) and all(len(k) == 2 and k[0] == k[1] for _, k in self.collapsed)


def _normalise(terms: Any, x: Tensor, directions: Any) -> _Terms:
    n = math.prod(x.shape[1:])
    vectors = _checks.check_directions(directions, x)
    labels = n if vectors is None else vectors.shape[0]
    merged: dict[Key, Any] = {}
    read: list[tuple[Tensor, Key]] = []
    for coef, key in _checks.check_terms(terms, x, labels, vectors is not None):
        if isinstance(coef, Tensor) and coef.dim() >= 2:
            read.append((coef.reshape(coef.shape[0], -1), key))
        else:
            w = coef.reshape(1, -1) if isinstance(coef, Tensor) else float(coef)
            merged[key] = w if key not in merged else merged[key] + w
    return _Terms([(w, k) for k, w in merged.items()], read, vectors)


def _slice(w: Any, sl: slice, dim: int) -> Any:
    if isinstance(w, Tensor) and w.shape[dim] != 1:
        return w[(slice(None),) * dim + (sl,)]
    return w


def _times(value: Tensor, w: Any, per_sample: bool) -> Tensor:
    """value (b, Y) times a number, a per-sample weight (1, b) or an output weight (1 | b, Y)."""
    if not isinstance(w, Tensor):
        return value if w == 1.0 else w * value
    return value * (w.reshape(-1, 1) if per_sample else w)


def _vectors(vectors: Optional[Tensor], labels: Sequence[int], z: Tensor) -> Tensor:
    """The directions of ``labels``: (L, 1 | b, N)."""
    if vectors is not None:
        return vectors[list(labels)]
    e = z.new_zeros(len(labels), 1, z.shape[1])
    e[torch.arange(len(labels), device=e.device), 0, torch.as_tensor(list(labels), dtype=torch.long, device=e.device)] = 1
    return e


def _weights(ws: Sequence[Any], z: Tensor) -> Optional[Tensor]:
    """Weights of the diagonal terms as (L, 1 | b), None when all are 1."""
    if all(not isinstance(w, Tensor) and w == 1.0 for w in ws):
        return None
    rows = [w.reshape(-1) if isinstance(w, Tensor) else z.new_full((1,), w) for w in ws]
    width = max(r.shape[0] for r in rows)
    return torch.stack([r.expand(width) for r in rows])


def _evaluate(t: Target, spec: _Terms, z: Tensor, scale: Optional[Tensor], sl: slice) -> Tensor:
    """L u for the samples ``sl`` of t.z (all of them when coupled): (b, Y)."""
    vectors = None if spec.directions is None else _slice(spec.directions, sl, 1)
    collapsed = [(_slice(w, sl, 1), k) for w, k in spec.collapsed]
    read = [(_slice(w, sl, 0), k) for w, k in spec.read]
    parts: list[Tensor] = []
    if t.program is not None:
        if spec.diagonal():  # the forward Laplacian along the directions, in chunks (see _operands)
            vec = _vectors(vectors, [k[0] for _, k in collapsed], z)
            weights = _weights([w for w, _ in collapsed], z)
            chunks, _ = direction_chunks(t, vec.shape[0], None, SUM_PASS_BYTES)
            sums = [_collapsed.second(t.program, z, t.in_shape, vec[c.start : c.stop],
                                      None if weights is None else weights[c.start : c.stop]) for c in chunks]
            return sum(sums[1:], sums[0])
        top = [(w, k) for w, k in collapsed if k]
        keys = [k for _, k in read if k]
        summed, reads, value = _collapsed.operator(t.program, z, t.in_shape, top, keys, vectors)
        if top:
            parts.append(summed)
        parts += [_times(r, w, False) for r, (w, _) in zip(reads, [(w, k) for w, k in read if k])]
        parts += [_times(value, w, True) for w, k in collapsed if not k]
        parts += [_times(value, w, False) for w, k in read if not k]
    else:
        for group, per_sample in ((collapsed, True), (read, False)):
            for w, k in group:
                if vectors is None:  # coordinates: the derivative operators' generic engine (exact formulas,
                    value = t.run("partial", z, tuple(k), scale=scale)  # reverse nesting where needed)
                else:
                    tangents = [_vectors(vectors, [d], z)[0] for d in k]
                    stack = torch.stack(tangents)[None] if tangents else z.new_zeros(1, 0, 1, z.shape[1])
                    with _generic(len(k)):
                        value = _directional.terms(t.fn, z, [stack], scale)[0][0]
                parts.append(_times(value, w, per_sample))
    if not parts:
        return z.new_zeros(z.shape[0], math.prod(t.out_shape))
    return sum(parts[1:], parts[0])


def _per_sample(t: Target, opts: Options, compute: Callable[[Tensor, Optional[Tensor], slice], Tensor]) -> Tensor:
    """``compute(z, scale, samples)`` over all samples, chunk_size samples per pass: (B, Y)."""
    batch = t.z.shape[0]
    if t.coupled:
        return t.over_samples(opts.chunk_size, (), lambda z, s: compute(z, s, slice(None)))
    width = batch if opts.chunk_size is None else max(1, opts.chunk_size)
    if batch == 0:
        return t.z.new_zeros(0, math.prod(t.out_shape))
    blocks = [t.chunk(compute, s, s + width, slice(s, s + width)) for s in range(0, batch, width)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


@_guard.entry(_args.trailing_inputs("terms", lambda v: _is_terms(v)))
def operator(
    f: Callable[..., Any],
    *args: Any,
    terms: Optional[Sequence[tuple[Any, Sequence[Any]]]] = None,
    directions: Optional[Tensor] = None,
    argnums: Optional[Argnums] = None,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Any:
    """Per-sample linear differential operator sum_k c_k d^(a_k) f, collapsed where f is captured.

    Each term ``(c, dims)`` is a coefficient and the coordinates to differentiate along, as in
    :func:`jacmode.partial` (``(1, 1)`` is f_x1x1, ``()`` is f itself). With ``directions`` (M, D)
    (or per sample (B, M, D)), ``dims`` index its rows instead: ``(0, 1)`` is the mixed directional
    derivative D^2 f[v_0, v_1]. On the Taylor path the highest-order coefficients of all terms are
    summed as they are formed (collapsed Taylor mode), so the cost follows the number of distinct
    lower-order sub-multisets of the terms, not the number of terms (:func:`operator_plan`).

    Args:
        f: maps x of shape (B, D) (or (B, *in), coordinates counted flat) to (B, *out); or any
            f(*args).
        *args: x, the batch of points, shape (B, D); or all of f's positional arguments.
        terms: a list of ``(c, dims)``; c is a number, a tensor (B,) (one coefficient per sample)
            or a tensor of shape (1 | B, *out) (one per output component, e.g. the divergence's
            e_d; such terms are carried to the output, not collapsed). dims name coordinates as
            :func:`jacmode.partial` does (``("t",)``, ``("x", "x")``). ``operator(f, x, terms)``
            still reads the list as terms when f takes one argument; with several, pass ``terms=``.
        directions: None for coordinates, else the vectors that ``dims`` index: (M, D) or (B, M, D).
        argnums: the differentiated positional arguments (an int or a tuple, torch.func's
            convention); by default those the terms name, else 0; the others are passed through.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples) or
            None (broadcast); for all, per positional argument (a tuple), or by name (a dict).
        kwargs: keyword arguments for f, passed through.
        has_aux: f returns ``(output, aux)``; the result is then ``(result, aux)``.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: samples per pass (all of them by default).
        create_graph: keep the result differentiable with respect to parameters and input.

    Returns:
        Shape (B, *out): the operator applied to every output component.

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.], [3., 1.]])
        >>> u = lambda x: x[:, :1] ** 2 * x[:, 1:] ** 3      # u = x0^2 x1^3, shape (B, 1)
        >>> jm.operator(u, x, [(1.0, (0, 0)), (1.0, (1, 1)), (-2.0, ())])   # u_00 + u_11 - 2 u
        tensor([[12.],
                [38.]])
        >>> heat = [(1.0, ("t",)), (-0.5, ("x", "x"))]            # u_t - 0.5 u_xx of v(x, t)
        >>> jm.operator(lambda x, t: x ** 2 * t, x[:, :1], x[:, 1:], terms=heat)   # x^2 - t
        tensor([[-1.],
                [ 8.]])
    """
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    call, terms = _front(f, args, terms, argnums, in_dims, kwargs, has_aux, directions)
    result = _operator(call.fn, call.x, terms, directions, structure, chunk_size, create_graph)
    return result if call.simple else _args.finish(call, call.outputs(result, (call.x.shape[0],)))


def _is_terms(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(t, tuple) and len(t) == 2 for t in v)


def _front(f: Any, args: tuple[Any, ...], terms: Any, argnums: Any, in_dims: Any, kwargs: Any, has_aux: Any,
           directions: Any) -> tuple[_args.Call, Any]:
    """The call of :func:`operator` / :func:`operator_plan` and its terms with coordinates resolved."""
    args, legacy = _args.legacy_trailing(f, args, terms is not None, _is_terms, "terms",
                                         "jm.operator(u, x, t, terms=[(1.0, ('t',)), (-0.5, ('x', 'x'))])")
    terms = legacy if legacy is not None else terms
    if terms is None:
        raise TypeError("terms: missing: pass a list of (coefficient, dims), e.g. terms=[(1.0, (0, 0)), (1.0, (1, 1))].")
    coords = [c for t in terms if isinstance(t, tuple) and len(t) == 2 and isinstance(t[1], (tuple, list))
              for c in t[1]] if directions is None and isinstance(terms, (list, tuple)) else []
    if argnums is None:
        named = _args.coordinate_args(coords, _args.parameter_names(f), "terms")
        argnums = named if named is not None else 0
    call = _args.front(f, args, kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux)
    if not call.simple and coords:
        terms = [(c, _args.resolve(call, list(d), "terms")) if isinstance(d, (tuple, list)) else (c, d)
                 for c, d in terms]
    return call, terms


def _operator(f: Fn, x: Tensor, terms: Any, directions: Any, structure: Any, chunk_size: Any,
              create_graph: Any) -> Tensor:
    """The body of :func:`operator` for a function of one tensor."""
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    spec = _normalise(terms, x, directions)

    def body(t: Target) -> Tensor:
        _checks.check_term_outputs(spec.read, x.shape[0], t.out_shape)
        flat = _per_sample(t, opts, lambda z, s, sl: _evaluate(t, spec, z, s, sl))
        return flat.reshape(x.shape[0], *t.out_shape)

    return evaluate(f, x, opts, body)


@_guard.entry(_args.trailing_inputs("terms", lambda v: _is_terms(v)))
def operator_plan(
    f: Callable[..., Any],
    *args: Any,
    terms: Optional[Sequence[tuple[Any, Sequence[Any]]]] = None,
    directions: Optional[Tensor] = None,
    argnums: Optional[Argnums] = None,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    structure: str = "auto",
) -> OperatorPlan:
    """What :func:`operator` would do for these terms: engine, directions and passes it costs.

    Args:
        f: as for :func:`operator`.
        *args: as for :func:`operator`.
        terms: as for :func:`operator`.
        directions: as for :func:`operator`.
        argnums: as for :func:`operator`.
        in_dims: as for :func:`operator`.
        kwargs: as for :func:`operator`.
        structure: as for :func:`operator`.

    Returns:
        An :class:`OperatorPlan`.

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> biharmonic = [(1.0, (i, i, j, j)) for i in range(3) for j in range(3)]
        >>> p = jm.operator_plan(net, torch.randn(4, 3), biharmonic)
        >>> p.engine, p.terms, p.coefficients
        ('collapsed Taylor mode', 6, 19)
    """
    call, terms = _front(f, args, terms, argnums, in_dims, kwargs, False, directions)
    f, x = call.fn, call.x
    opts = validated(f, x, "x", structure, None, False)
    spec = _normalise(terms, x, directions)
    keys = [k for _, k in spec.all()]
    order = max([len(k) for k in keys] or [0])
    n_dirs = len({d for k in keys for d in k})

    def body(t: Target) -> OperatorPlan:
        if t.program is not None:
            if spec.diagonal():
                carried, why = len(keys) + 1, "every operation has a rule: the forward Laplacian along the directions"
            else:
                top = [k for w, k in spec.collapsed if k]
                read = [k for _, k in spec.read if k]
                lower = {s for k in top + read for s in _sub_keys(k) if s and s != k} | set(read)
                carried, why = len(lower) + (1 if top else 0), "every operation has a rule: collapsed Taylor mode"
            return OperatorPlan("collapsed Taylor mode", len(keys), order, n_dirs, carried, carried + 1, why)
        reason = _capture_reason(f, x) if opts.structure != "coupled" else "structure='coupled'"
        return OperatorPlan("nested forward mode", len(keys), order, n_dirs, len(keys),
                            sum(2 ** len(k) for k in keys), reason)

    return evaluate(f, x, opts, body)


def _capture_reason(f: Fn, x: Tensor) -> str:
    return captured(f, x)[1] or "the captured graph does not serve this input"


def _draw(shape: tuple[int, ...], x: Tensor, distribution: str, generator: Optional[torch.Generator]) -> Tensor:
    if distribution == "gaussian":
        return torch.randn(shape, generator=generator, dtype=x.dtype, device=x.device)
    # the sign bits of random bytes: a third of the time of randint(0, 2) for the same draws
    n = math.prod(shape)
    words = torch.empty((n + 7) // 8, dtype=torch.int64, device=x.device).random_(-(2**63), None, generator=generator)
    signs = words.view(torch.int8)[:n].bitwise_right_shift(7).mul_(2).add_(1)  # -1 or 1, one byte each
    return signs.to(x.dtype).reshape(shape)


def _directions_of(t: Target, vectors: Tensor, order: int, z: Tensor, scale: Optional[Tensor],
                   per_direction: bool, weights: Optional[Tensor] = None) -> Tensor:
    """Directional derivatives of order 2 (summed unless per_direction) or 4 (per direction)."""
    if t.program is not None:
        if order == 2:
            return _collapsed.second(t.program, z, t.in_shape, vectors, weights, per_direction)
        return _collapsed.directional(t.program, z, t.in_shape, vectors, order)
    with _generic(order):
        if order == 2:
            return _directional.second(t.fn, z, vectors, weights, per_direction, scale)
        return _directional.directional(t.fn, z, vectors, order, scale)


@contextlib.contextmanager
def _generic(order: int) -> Iterator[None]:
    """Around the nested forward mode of the generic path: the decompositions of the torch ops whose
    own higher derivatives are wrong (``_rules/decompositions.py``), and a clear error for an op
    without a forward-mode formula (directions have no reverse nesting here)."""
    with decompositions.exact(decompositions.wanted(order)):
        try:
            yield
        except NotImplementedError as err:
            clear = missing_derivative(
                err, ("forward", "jvp"), "an operation in f has no forward-mode derivative of the order this operator needs",
                ", so the generic engine (nested forward mode along the directions) cannot run it. Make f traceable by "
                "torch.fx (jm.operator_plan says why it is not), write that operation in primitive ops, or use "
                "jm.partials / jm.laplacian with coordinates, which nest reverse mode instead.")
            if clear is None:
                raise
            raise clear from err


def _mean_and_error(each: Tensor) -> tuple[Tensor, Tensor]:
    """Mean over the K draws (K, B, Y) and its standard error (unbiased variance / K)."""
    k = each.shape[0]
    return each.mean(0), each.std(0, correction=1) / math.sqrt(k)


def _estimate(f: Fn, x: Tensor, opts: Options, vectors: Tensor, order: int, factor: float,
              return_std: bool) -> Result:
    """factor * mean over the K rows of ``vectors`` (K, B, N) of D^order f[v, ...], with its error."""
    k = vectors.shape[0]

    def body(t: Target) -> Result:
        def compute(z: Tensor, scale: Optional[Tensor], sl: slice) -> Tensor:
            v = vectors[:, sl]
            if order == 2 and not return_std:
                return _directions_of(t, v, 2, z, scale, False, v.new_full((k, 1), factor / k))
            each = _directions_of(t, v, order, z, scale, True) * factor
            if not return_std:  # (b, Y), as _per_sample expects
                return each.mean(0)
            mean, err = _mean_and_error(each)
            return torch.stack([mean, err])

        if return_std:
            both = _per_sample_pairs(t, opts, compute)
            return tuple(r.reshape(x.shape[0], *t.out_shape) for r in both)  # type: ignore[return-value]
        return _per_sample(t, opts, compute).reshape(x.shape[0], *t.out_shape)

    return evaluate(f, x, opts, body)


def _per_sample_pairs(t: Target, opts: Options, compute: Callable[[Tensor, Optional[Tensor], slice], Tensor]) -> Tensor:
    """As :func:`_per_sample` for results (2, b, Y) (estimate and error): (2, B, Y)."""
    batch = t.z.shape[0]
    if t.coupled:
        return t.over_samples(opts.chunk_size, (2,), lambda z, s: compute(z, s, slice(None)))
    width = batch if opts.chunk_size is None else max(1, opts.chunk_size)
    blocks = [t.chunk(compute, s, s + width, slice(s, s + width)) for s in range(0, batch, width)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, 1)


def weighted_laplacian(f: Fn, x: Tensor, opts: Options, weight: Any, samples: Any, distribution: Any,
                       generator: Any, return_std: Any) -> Result:
    """tr(C Hess f) with C = S S^T (S = ``weight``, identity when None), exact or estimated."""
    s = _checks.check_weight(weight, x)  # (R, 1 | B, N)
    k = _checks.check_estimator(samples, distribution, generator, return_std)
    if k is None:
        assert s is not None
        terms = [(1.0, (r, r)) for r in range(s.shape[0])]
        directions = s[:, 0] if s.shape[1] == 1 else s.transpose(0, 1)  # (R, N) or (B, R, N)
        return _operator(f, x, terms, directions, opts.structure, opts.chunk_size, opts.create_graph)
    n = math.prod(x.shape[1:])
    if s is None:
        vectors = _draw((k, x.shape[0], n), x, distribution, generator)
    else:
        xi = _draw((k, x.shape[0], s.shape[0]), x, distribution, generator)
        vectors = torch.einsum("kbr,rbn->kbn", xi, s.expand(s.shape[0], x.shape[0], n))
    return _estimate(f, x, opts, vectors, 2, 1.0, return_std)


@_guard.entry()
def biharmonic(
    f: Callable[..., Any],
    *args: Any,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    samples: Optional[int] = None,
    distribution: str = "gaussian",
    generator: Optional[torch.Generator] = None,
    return_std: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Result:
    """Per-sample biharmonic operator sum_(i,j) d^4 f / dx_i^2 dx_j^2, exact or estimated.

    Exact (``samples=None``): one collapsed Taylor pass over the terms u_iijj (the orders 1-3 of
    their sub-multisets and one summed fourth order, :func:`operator`), nested forward mode for any
    other f. Estimated (``samples=K``): the mean of D^4 f[v, v, v, v] / 3 over K standard Gaussian
    directions per sample (unbiased, the STDE construction; see the note in ``_operators.py``).

    Args:
        f: maps x of shape (B, D) (or (B, *in)) to (B, *out); or any f(*args).
        *args: x, the batch of points; or all of f's positional arguments.
        argnums: the differentiated positional arguments (an int or a tuple, torch.func's
            convention); default 0; the others are passed through.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples) or
            None (broadcast); for all, per positional argument (a tuple), or by name (a dict).
        kwargs: keyword arguments for f, passed through.
        has_aux: f returns ``(output, aux)``; the result is then ``(result, aux)``.
        samples: None for the exact value, else the number K of random directions per sample.
        distribution: "gaussian" (the only law with the right fourth moments).
        generator: a ``torch.Generator`` for reproducible draws.
        return_std: also return the standard error of the estimate (needs samples >= 2).
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: samples per pass (all of them by default).
        create_graph: keep the result differentiable with respect to parameters and input.

    Returns:
        Shape (B, *out); with ``return_std`` a pair (estimate, standard error), both (B, *out).

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.]])
        >>> jm.biharmonic(lambda x: (x ** 4).sum(1) + (x[:, 0] * x[:, 1]) ** 2, x)   # 24 + 24 + 8
        tensor([56.])
    """
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    call = _args.front(f, args, kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux)
    result = _biharmonic(call.fn, call.x, samples, distribution, generator, return_std, structure, chunk_size,
                         create_graph)
    if call.simple:
        return result
    lead = (call.x.shape[0],)
    out = tuple(call.outputs(r, lead) for r in result) if isinstance(result, tuple) else call.outputs(result, lead)
    return _args.finish(call, out)


def _biharmonic(f: Fn, x: Tensor, samples: Any, distribution: Any, generator: Any, return_std: Any,
                structure: Any, chunk_size: Any, create_graph: Any) -> Result:
    """The body of :func:`biharmonic` for a function of one tensor."""
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    k = _checks.check_estimator(samples, distribution, generator, return_std, allowed=("gaussian",))
    n = math.prod(x.shape[1:])
    if k is None:
        terms = [(1.0 if i == j else 2.0, (i, i, j, j)) for i in range(n) for j in range(i, n)]
        return _operator(f, x, terms, None, structure, chunk_size, create_graph)
    vectors = _draw((k, x.shape[0], n), x, "gaussian", generator)
    return _estimate(f, x, opts, vectors, 4, 1.0 / 3.0, return_std)
