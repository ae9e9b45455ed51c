"""What every rule works on: a traced tensor with its Taylor coefficients, and the shared helpers.

A :class:`Traced` is one tensor of the captured graph that depends on the input: its ``value``
(B, *shape) and its Taylor coefficients ``coef[key]`` of shape (L, 1 or B, *shape), one leading
dimension of directions (L = 1 for a single multiset coefficient, K directions, P pairs) and the
batch dimension, 1 where the coefficient is the same for every sample (a seed e_d before it meets
anything sample-dependent). A missing key is a coefficient that is zero everywhere.

A rule maps its arguments (Traced for what depends on the input, plain values otherwise) to a
Traced, with the help of an :class:`Algebra` (``_engines/taylor.py``) that knows which
coefficients are carried and how products and elementwise functions combine them. Rules that are
linear in their traced input need no algebra: :func:`linear` applies the map to every coefficient.
A rule raises :class:`Unsupported` when its arguments break what the engines assume (the batch
stays dimension 0 and samples stay independent); the whole call then takes the generic engine.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from torch import Tensor

from .elementwise import Jet


class Unsupported(Exception):
    """An operation the fast path cannot treat exactly: the caller falls back to the generic engine."""


class Traced:
    """A tensor that depends on the input, with its Taylor coefficients (see the module note).

    ``value`` (B, *shape) may be given as ``make``, computed on first use: the value of the last
    linear layer is never needed when only derivatives are asked for.
    """

    __slots__ = ("_value", "_make", "coef")

    def __init__(self, value: Optional[Tensor], coef: dict[Any, Tensor],
                 make: Optional[Callable[[], Tensor]] = None) -> None:
        self._value, self._make = value, make
        self.coef = coef  # key -> (L, 1 | B, *shape); missing = zero

    @property
    def value(self) -> Tensor:
        if self._value is None:
            assert self._make is not None
            self._value, self._make = self._make(), None
        return self._value


class Algebra(Protocol):
    """Which coefficients are carried, and how the nonlinear rules combine them."""

    order: int  # the highest derivative order an elementwise function must provide

    def elementwise(self, x: Traced, jet: Callable[[Tensor, int], Jet]) -> Traced: ...

    def mul(self, a: Traced, b: Traced) -> Traced: ...


Map = Callable[[Tensor], Tensor]


def linear(x: Traced, value: Map, coef: Optional[Map] = None) -> Traced:
    """A map linear in x (plus a constant): ``value`` on x.value, ``coef`` (default ``value``) on coefficients."""
    c = value if coef is None else coef
    return Traced(None, {k: c(t) for k, t in x.coef.items()}, lambda: value(x.value))


def merged(fn: Map) -> Map:
    """``fn`` of a (N, *shape) batch applied to a coefficient (L, Bc, *shape) (e.g. convolutions)."""

    def apply(t: Tensor) -> Tensor:
        out = fn(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]))
        return out.reshape(t.shape[0], t.shape[1], *out.shape[1:])

    return apply


def batch_kept(x: Traced, out: Traced, what: str) -> Traced:
    """Check that an operation kept the batch as dimension 0 of its result."""
    if out.value.dim() == 0 or out.value.shape[0] != x.value.shape[0]:
        raise Unsupported(f"{what} changes the batch dimension ({tuple(x.value.shape)} -> {tuple(out.value.shape)})")
    return out


def feature_dim(dim: int, rank: int, what: str) -> int:
    """A dimension of a value of rank ``rank`` as a dimension of its coefficients (one more in front)."""
    d = dim + rank if dim < 0 else dim
    if not 0 < d < rank:
        raise Unsupported(f"{what} over dimension {dim} mixes the samples of the batch")
    return d + 1


def expand_batch(tensors: list[Tensor]) -> list[Tensor]:
    """Coefficients expanded to a common direction and batch size (before cat/stack)."""
    lead = max(t.shape[0] for t in tensors), max(t.shape[1] for t in tensors)
    return [t.expand(*lead, *t.shape[2:]) for t in tensors]
