"""Taylor mode over a captured graph: derivative coefficients pushed op by op with plain torch ops.

The captured :class:`~jacmode._capture.capture.Program` of any traceable module (an
``nn.Sequential`` is one more) is run with :class:`~jacmode._rules.base.Traced` tensors that carry
Taylor coefficients; the rules of ``_rules/`` say how each operation transforms them. Plain torch
operations keep the results differentiable with respect to the parameters and the input
(``create_graph=True``), and every rule treats each sample on its own, so the samples are
independent by construction.

NOTE: [Taylor mode over multisets]
The mixed partial d^k f / dx_(d1) ... dx_(dk) is the derivative of f(x + t_1 e_(d1) + ... +
t_k e_(dk)) with respect to t_1 ... t_k at 0. Nested forward mode carries one coefficient per
subset of {1..k}, 2^k in all. But a coefficient only depends on which coordinates its subset
differentiates along, the sub-multiset of (d1..dk), so one per sub-multiset is enough: k + 1 for
d^k / dt^k, 6 instead of 8 for u_xxy. Through a linear map every coefficient is mapped (a bias goes
to the value only); through an elementwise ``y = s(h)`` Faa di Bruno's formula over set partitions
gives y_K = sum over partitions pi of K of s^(|pi|)(h) prod_(block in pi) h_block, with the
partitions that give the same blocks grouped and counted once (``_terms``); through a product
Leibniz's rule gives (uv)_K = sum over sub-multisets S of K of C(K, S) u_S v_(K - S), C the product
of the binomial coefficients of the labels. The input coefficients are x itself, e_d (one row,
broadcast over all samples, so the cost does not grow with B beyond the batched pass) and zero
above first order. Several partials (``partials``) share one propagation over the union of their
sub-multisets.

Second-order operators vectorise the directions instead: the Hessian carries the D first-order
coefficients as one (D, B, H) tensor and the wanted pairs (i, j) as one (P, B, H) tensor, with
y_ij = s'(h) h_ij + s''(h) h_i h_j; the Laplacian needs only the sum over i of h_ii, so it carries
that sum (the forward Laplacian, or collapsed Taylor mode): L' = s'(h) L + s''(h) sum_i h_i^2.
A product uv adds the cross term u_i v_j + u_j v_i (summed over i for the Laplacian).

NOTE: [Ranks of values and coefficients]
A value (B, *shape) meets coefficients (L, 1|B, *shape). The rules combine them as value[None]
(1, B, *shape), never as the bare value: under ``create_graph`` a broadcast from (B, ...) to
(1, B, ...) makes the backward pass reduce every gradient over the new size-1 dimension (a zero
fill and a sum, two full passes per use), while the view's own backward is free.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from .._rules.base import Seed, Traced, Unsupported
from .._rules.elementwise import Jet, combine
from .capture import Program
from .._autodiff.nested import seeds

Key = tuple[int, ...]  # a multiset of coordinates, sorted
Term = tuple[int, int, tuple[Key, ...]]  # (how many partitions, order of s, blocks)


def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[head], *part]
        for i in range(len(part)):
            yield [*part[:i], [head, *part[i]], *part[i + 1 :]]


@functools.lru_cache(maxsize=None)
def _terms(key: Key) -> tuple[Term, ...]:
    """Faa di Bruno's formula for the coefficient ``key``, partitions with equal blocks grouped."""
    counts: Counter = Counter()
    for part in _set_partitions(list(range(len(key)))):
        counts[tuple(sorted(tuple(key[i] for i in block) for block in part))] += 1
    return tuple((n, len(blocks), blocks) for blocks, n in sorted(counts.items()))


@functools.lru_cache(maxsize=None)
def _sub_keys(target: Key) -> tuple[Key, ...]:
    """All sub-multisets of ``target``, by increasing size (the empty one first)."""
    counts = Counter(target)
    labels = sorted(counts)
    keys = [
        tuple(label for label, n in zip(labels, ns) for _ in range(n))
        for ns in itertools.product(*(range(counts[label] + 1) for label in labels))
    ]
    return tuple(sorted(keys, key=len))


@functools.lru_cache(maxsize=None)
def _leibniz(key: Key) -> tuple[tuple[int, Key, Key], ...]:
    """(C(K, S), S, K - S) for every sub-multiset S of K."""
    counts = Counter(key)
    out = []
    for sub in _sub_keys(key):
        rest = counts - Counter(sub)
        coeff = math.prod(math.comb(counts[label], n) for label, n in Counter(sub).items())
        out.append((coeff, sub, tuple(sorted(rest.elements()))))
    return tuple(out)


def _product(count: int, factors: Sequence[Tensor]) -> Tensor:
    out = factors[0] if count == 1 else count * factors[0]
    for f in factors[1:]:
        out = out * f
    return out


def _add(a: Optional[Tensor], b: Tensor) -> Tensor:
    return b if a is None else a + b


class Multisets:
    """Coefficients per sub-multiset of the wanted partials (see the note)."""

    def __init__(self, targets: Sequence[Key]) -> None:
        keys = {k for t in targets for k in _sub_keys(t) if k}
        self.keys = sorted(keys, key=lambda k: (len(k), k))
        self.order = max(len(t) for t in targets)

    def seed(self, z: Tensor) -> Traced:
        labels = sorted({k[0] for k in self.keys if len(k) == 1})
        e = seeds(z.reshape(z.shape[0], -1), labels).reshape(len(labels), 1, 1, *z.shape[1:])
        return Traced(z, {(d,): e[i] for i, d in enumerate(labels)})

    def elementwise(self, x: Traced, jet: Callable[[Tensor, int], Jet]) -> Traced:
        act = jet(x.value.unsqueeze(0), self.order)  # see the note on ranks of values
        new: dict[Any, Tensor] = {}
        for key in self.keys:
            grouped: dict[int, Tensor] = {}  # order m of s -> sum of the products it multiplies
            for count, m, blocks in _terms(key):
                if m > 1 and act.higher[m] is not None and all(b in x.coef for b in blocks):
                    grouped[m] = _add(grouped.get(m), _product(count, [x.coef[b] for b in blocks]))
            out = combine(act, x.coef.get(key), list(grouped.items()))
            if out is not None:
                new[key] = out
        return Traced(act.value[0], new)

    def mul(self, a: Traced, b: Traced) -> Traced:
        new: dict[Any, Tensor] = {}
        va, vb = a.value.unsqueeze(0), b.value.unsqueeze(0)
        for key in self.keys:
            total: Optional[Tensor] = None
            for count, s, rest in _leibniz(key):
                u = va if not s else a.coef.get(s)
                v = vb if not rest else b.coef.get(rest)
                if u is not None and v is not None:
                    total = _add(total, u * v if count == 1 else count * (u * v))
            if total is not None:
                new[key] = total
        return Traced(a.value * b.value, new)


class Stacked:
    """First derivatives along K directions as one (K, 1|B, ...) tensor "g", and optionally the
    second-order coefficients "s" whose products ``cross(u, v)`` pick pairs or sum the diagonal."""

    def __init__(self, dims: Sequence[int], cross: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
                 lazy: bool = False) -> None:
        self.dims, self.cross = list(dims), cross
        self.order = 1 if cross is None else 2
        self.spare: set[int] = set()  # coefficients the running step may overwrite (Program.run)
        self.lazy = lazy  # the input's seed is built only if a rule other than a linear map reads it
        self.built = False  # whether it was
        self.directions_last = False  # see [Directions last] in _rules/linear.py

    def seed(self, z: Tensor) -> Traced:
        def make() -> dict[Any, Tensor]:
            self.built = True
            return {"g": seeds(z.reshape(z.shape[0], -1), self.dims).reshape(len(self.dims), 1, *z.shape[1:])}

        if self.lazy:  # see [Seeds as columns] in _rules/base.py
            wrap = lambda cols: {"g": cols.reshape(cols.shape[0], 1, *cols.shape[1:])}  # noqa: E731
            return Traced(z, None, coef_make=make, seed=Seed(self.dims, wrap))
        return Traced(z, make())

    def elementwise(self, x: Traced, jet: Callable[[Tensor, int], Jet]) -> Traced:
        act = jet(x.value.unsqueeze(0), self.order)
        g, new = x.coef.get("g"), {}
        if self.cross is not None:
            s = combine(act, x.coef.get("s"), [] if g is None else [(2, self.cross(g, g))])
            if s is not None:
                new["s"] = s
        if g is not None:
            if id(g) in self.spare and g.shape[1] == act.value.shape[1]:  # dead after this step: reuse it
                new["g"] = g.mul_(act.first(torch.ones_like(act.value)))  # no fresh allocation (see _operands)
            else:
                new["g"] = act.first(g)
        return Traced(act.value[0], new)

    def mul(self, a: Traced, b: Traced) -> Traced:
        new: dict[Any, Tensor] = {}
        va, vb = a.value.unsqueeze(0), b.value.unsqueeze(0)
        for key in ("g", "s") if self.cross is not None else ("g",):
            u, v = a.coef.get(key), b.coef.get(key)
            total = None if u is None else u * vb
            if v is not None:
                total = _add(total, va * v)
            if total is not None:
                new[key] = total
        ga, gb = a.coef.get("g"), b.coef.get("g")
        if self.cross is not None and ga is not None and gb is not None:
            new["s"] = _add(new.get("s"), self.cross(ga, gb) + self.cross(gb, ga))
        return Traced(a.value * b.value, new)


def _run(program: Program, alg: Any, z: Tensor, in_shape: tuple[int, ...]) -> Traced:
    out = program.run(alg, alg.seed(z.reshape(z.shape[0], *in_shape)))
    if isinstance(out, Traced):
        return out
    if isinstance(out, Tensor):
        return Traced(out, {})
    raise Unsupported(f"the captured graph returns {type(out).__name__}, not one tensor")


def _flat(c: Optional[Tensor], out: Traced, lead: int, batch: int) -> Tensor:
    """A coefficient (L, 1|B, *out) as (lead, B, Y), zeros where it is missing."""
    if c is None:
        return out.value.new_zeros(lead, batch, math.prod(out.value.shape[1:]))
    y = math.prod(c.shape[2:])
    return c.reshape(c.shape[0], c.shape[1], y).expand(lead, batch, y)


def partials(program: Program, z: Tensor, in_shape: tuple[int, ...], targets: Sequence[Key]) -> Tensor:
    """Per-sample mixed partials, one per target multiset, from one propagation: (K, B, Y)."""
    keys = [tuple(sorted(t)) for t in targets]
    out = _run(program, Multisets(keys), z, in_shape)
    return torch.stack([_flat(out.coef.get(k), out, 1, z.shape[0])[0] for k in keys])


def partial(program: Program, z: Tensor, in_shape: tuple[int, ...], dims: Key) -> Tensor:
    """Per-sample mixed partial along ``dims``: z (B, D) -> (B, Y)."""
    out = _run(program, Multisets([tuple(sorted(dims))]), z, in_shape)
    return _flat(out.coef.get(tuple(sorted(dims))), out, 1, z.shape[0])[0]


def first(program: Program, z: Tensor, in_shape: tuple[int, ...], dims: Sequence[int]) -> Tensor:
    """First derivatives along each d in ``dims``: z (B, D) -> (k, B, Y)."""
    alg = Stacked(dims, lazy=True)
    alg.directions_last = True  # the (k, B, Y) result is read as (B, Y, k): see [Directions last]
    out = _run(program, alg, z, in_shape)
    return _flat(out.coef.get("g"), out, len(dims), z.shape[0])


SEED_BUILT = "seed built"  # Program.checked[(SEED_BUILT, *shape key)]: see seed_built


def value(program: Program, x: Tensor) -> Tensor:
    """f(x) computed by the program (with one coefficient, so that every rule runs).

    Also records, for inputs shaped like x, whether a first-order pass builds the one-hot seed or
    takes the columns of the linear maps that read the input ([Seeds as columns] in
    ``_rules/base.py``), for the cost model (:func:`seed_built`).
    """
    alg = Stacked([0], lazy=True)
    out = _run(program, alg, x.reshape(x.shape[0], -1), tuple(x.shape[1:])).value
    program.checked[(SEED_BUILT, tuple(x.shape[1:]), x.dtype, x.device.type)] = "built" if alg.built else "columns"
    return out


def seed_built(program: Program, in_shape: tuple[int, ...], like: Tensor) -> bool:
    """Whether forward mode over ``program`` builds the (D, 1, *in_shape) one-hot seed (True when unknown)."""
    return program.checked.get((SEED_BUILT, tuple(in_shape), like.dtype, like.device.type)) != "columns"


def pairs(program: Program, z: Tensor, in_shape: tuple[int, ...], ii: Sequence[int], jj: Sequence[int]) -> Tensor:
    """Second derivatives d^2 f / dx_i dx_j for the pairs (ii[p], jj[p]): z (B, D) -> (P, B, Y)."""
    a, b = list(ii), list(jj)
    out = _run(program, Stacked(range(z.shape[1]), lambda u, v: u[a] * v[b]), z, in_shape)
    return _flat(out.coef.get("s"), out, len(a), z.shape[0])


def laplacian(program: Program, z: Tensor, in_shape: tuple[int, ...], dims: Sequence[int]) -> Tensor:
    """Sum over d in dims of d^2 f / dx_d^2 (the forward Laplacian): z (B, D) -> (B, Y)."""
    out = _run(program, Stacked(dims, lambda u, v: (u * v).sum(0, keepdim=True)), z, in_shape)
    return _flat(out.coef.get("s"), out, 1, z.shape[0])[0]
