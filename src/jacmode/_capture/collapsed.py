"""Linear differential operators in collapsed Taylor mode over a captured graph.

The operator L u = sum_k c_k D^(|a_k|) u [v_(a_k)] is a weighted sum of mixed directional
derivatives; a_k is a multiset of direction labels and v_l the direction of label l (the
coordinate vector e_l, a column of a weight S, or a random draw). The coefficients c_k are numbers
or per-sample tensors (1, B, 1, ...).

NOTE: [Collapsed Taylor mode]
In the multiset algebra of ``taylor.py`` the coefficient of a target multiset K is, through an
elementwise ``y = s(h)``, y_K = s'(h) h_K + (products of coefficients of proper sub-multisets of
K), through a product Leibniz's (uv)_K = u_K v + u v_K + (products of proper sub-multisets), and
through a linear map just the map. The top coefficients h_K of the targets only ever enter
linearly, so their weighted sum H = sum_k c_k h_(a_k) can be carried as one tensor ("top"):
Y = s'(h) H + sum_k c_k (lower products of a_k), (uv)_top = u_top v + u v_top + sum_k c_k (lower
products). The pass then carries one coefficient per distinct proper sub-multiset of the targets
and one for all of them together: the forward Laplacian (D first-order coefficients and their
summed second order) is the case a_k = (k, k); the biharmonic sum_(i,j) u_iijj carries the orders
1-3 of its sub-multisets and one fourth-order sum. A target that is also a sub-multiset of another
one (u_x next to u_xx) is carried anyway and read out at the end; so is a term whose coefficient
depends on the output component (as the divergence's), since its weight exists only at the output.

``Directions`` is the Stacked algebra of ``taylor.py`` with directions given as vectors
(L, 1 | B, *in) rather than coordinates: a weighted Laplacian tr(S S^T Hess u) = sum_r D^2 u[s_r, s_r]
(one direction per column of S, per sample when S is), and the randomised estimators, whose
per-sample random directions are (K, B, *in). With ``per_direction`` the second-order coefficients
stay one per direction (K, B, ...) instead of their sum, for the estimator's spread.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .._rules.base import Traced
from .._rules.elementwise import Jet, combine
from .capture import Program
from .taylor import (
    Key,
    Multisets,
    Stacked,
    _add,
    _flat,
    _leibniz,
    _product,
    _run,
    _sub_keys,
    _terms,
)

Weight = Union[float, Tensor]  # a number or (1, B, 1, ..., 1), broadcast against coefficients
TOP = "top"


def _scaled(w: Weight, t: Tensor) -> Tensor:
    if isinstance(w, Tensor):
        return t * w.reshape(1, w.shape[1], *([1] * (t.dim() - 2)))
    return t if w == 1.0 else w * t


class Collapsed(Multisets):
    """Coefficients per proper sub-multiset of the targets, plus their collapsed weighted top."""

    def __init__(self, collapsed: Sequence[tuple[Weight, Key]], read: Sequence[Key],
                 directions: Optional[Tensor] = None) -> None:
        self.collapsed = [(w, k) for w, k in collapsed if k]
        self.directions = directions  # (M, 1 | B, *in) for labels 0..M-1, None: coordinates
        targets = [k for _, k in self.collapsed] + [k for k in read if k]
        lower = {s for k in targets for s in _sub_keys(k) if s and s != k}
        self.keys = sorted(lower | {k for k in read if k}, key=lambda k: (len(k), k))
        self.order = max([len(k) for k in targets] or [1])

    def seed(self, z: Tensor) -> Traced:
        labels = sorted({k[0] for k in self.keys if len(k) == 1} | {k[0] for _, k in self.collapsed if len(k) == 1})
        if self.directions is None:
            flat = z.reshape(z.shape[0], -1)
            e = flat.new_zeros(len(labels), 1, flat.shape[1])
            e[torch.arange(len(labels), device=e.device), 0, torch.as_tensor(labels, dtype=torch.long, device=e.device)] = 1
            vec = {d: e[i].reshape(1, 1, *z.shape[1:]) for i, d in enumerate(labels)}
        else:
            vec = {d: self.directions[d][None] for d in labels}
        coef: dict[Any, Tensor] = {(d,): vec[d] for d in labels if (d,) in self.keys}
        top = [_scaled(w, vec[k[0]]) for w, k in self.collapsed if len(k) == 1]
        if top:  # first-order terms start the collapsed sum
            coef[TOP] = sum(top[1:], top[0])
        return Traced(z, coef)

    def elementwise(self, x: Traced, jet: Callable[[Tensor, int], Jet]) -> Traced:
        acts: list[Jet] = []

        def kept(h: Tensor, n: int) -> Jet:
            acts.append(jet(h, n))
            return acts[-1]

        out = super().elementwise(x, kept)  # the lower coefficients; the jet is evaluated once
        act = acts[0]
        grouped: dict[int, Tensor] = {}
        for w, key in self.collapsed:
            for count, m, blocks in _terms(key):
                if m > 1 and act.higher[m] is not None and all(b in x.coef for b in blocks):
                    grouped[m] = _add(grouped.get(m), _scaled(w, _product(count, [x.coef[b] for b in blocks])))
        top = combine(act, x.coef.get(TOP), list(grouped.items()))
        if top is not None:
            out.coef[TOP] = top
        return out

    def mul(self, a: Traced, b: Traced) -> Traced:
        out = super().mul(a, b)
        va, vb = a.value.unsqueeze(0), b.value.unsqueeze(0)
        total: Optional[Tensor] = None
        if TOP in a.coef:
            total = a.coef[TOP] * vb
        if TOP in b.coef:
            total = _add(total, va * b.coef[TOP])
        for w, key in self.collapsed:
            for count, s, rest in _leibniz(key):
                if s and rest and s in a.coef and rest in b.coef:
                    uv = a.coef[s] * b.coef[rest]
                    total = _add(total, _scaled(w, uv if count == 1 else count * uv))
        if total is not None:
            out.coef[TOP] = total
        return out


def operator(program: Program, z: Tensor, in_shape: tuple[int, ...], collapsed: Sequence[tuple[Weight, Key]],
             read: Sequence[Key], directions: Optional[Tensor] = None) -> tuple[Tensor, list[Tensor], Tensor]:
    """The collapsed sum (B, Y), the read-out coefficients [(B, Y)] and the value (B, Y)."""
    out = _run(program, Collapsed(collapsed, read, directions), z, in_shape)
    batch = z.shape[0]
    top = _flat(out.coef.get(TOP), out, 1, batch)[0]
    return top, [_flat(out.coef.get(k), out, 1, batch)[0] for k in read], out.value.reshape(batch, -1)


class Directions(Stacked):
    """Stacked first-order coefficients along given vectors, second order summed or per direction."""

    def __init__(self, vectors: Tensor, weights: Optional[Tensor] = None, per_direction: bool = False) -> None:
        self.vectors = vectors  # (L, 1 | B, *in)
        w = weights  # (L, 1 | B) or None

        def cross(u: Tensor, v: Tensor) -> Tensor:
            uv = u * v
            if w is not None:
                uv = uv * w.reshape(*w.shape, *([1] * (uv.dim() - 2)))
            return uv if per_direction else uv.sum(0, keepdim=True)

        super().__init__(range(vectors.shape[0]), cross)

    def seed(self, z: Tensor) -> Traced:
        return Traced(z, {"g": self.vectors})


def second(program: Program, z: Tensor, in_shape: tuple[int, ...], vectors: Tensor,
           weights: Optional[Tensor] = None, per_direction: bool = False) -> Tensor:
    """sum_l w_l D^2 f[v_l, v_l] (B, Y), or each term (L, B, Y) with ``per_direction``."""
    out = _run(program, Directions(vectors.reshape(*vectors.shape[:2], *in_shape), weights, per_direction),
               z, in_shape)
    lead = vectors.shape[0] if per_direction else 1
    flat = _flat(out.coef.get("s"), out, lead, z.shape[0])
    return flat if per_direction else flat[0]


def directional(program: Program, z: Tensor, in_shape: tuple[int, ...], vectors: Tensor, order: int) -> Tensor:
    """D^k f[v_l, ..., v_l] for each of the L directions (L, 1 | B, *in): (L, B, Y)."""
    key = (0,) * order
    alg = Multisets([key])
    v = vectors.reshape(*vectors.shape[:2], *in_shape)
    out = program.run(alg, Traced(z.reshape(z.shape[0], *in_shape), {(0,): v}))
    if not isinstance(out, Traced):
        out = Traced(out, {})
    return _flat(out.coef.get(key), out, vectors.shape[0], z.shape[0])
