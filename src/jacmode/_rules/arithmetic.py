"""Rules for arithmetic: sums, differences, products and quotients of traced tensors and constants.

A traced tensor times a constant is linear in it; the product of two traced tensors is Leibniz's
rule, which the algebra of the engine carries out (``Algebra.mul``), so hard constraints such as
``x * (1 - x) * net(x)`` stay on the fast path. Quotients are products with the reciprocal
(an elementwise power), and ``c ** x`` is ``exp(log(c) x)``. Both operands must have the same rank
(so that broadcasting never mixes the batch with a feature dimension); constants may have fewer
dimensions than the traced tensor, never more.
"""

from __future__ import annotations

import math
import operator
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import Tensor

from .base import Algebra, Traced, Unsupported, linear
from .elementwise import FUNCTIONS


def _fit(x: Traced) -> Traced:
    """Coefficients broadcast to the shape of the value (after an operation that broadcast)."""
    shape = x.value.shape[1:]
    return Traced(x.value, {k: c if c.shape[2:] == shape else c.expand(*c.shape[:2], *shape) for k, c in x.coef.items()})


def _constant(c: Any, x: Traced, what: str) -> Any:
    if isinstance(c, Tensor) and c.dim() > x.value.dim():
        raise Unsupported(f"{what} broadcasts a traced tensor against a constant of higher rank")
    return c


def _same_rank(a: Traced, b: Traced, what: str) -> None:
    if a.value.dim() != b.value.dim():
        raise Unsupported(f"{what} of tensors of ranks {a.value.dim()} and {b.value.dim()} mixes batch and features")


def power(alg: Algebra, x: Traced, exponent: float) -> Traced:
    p = SimpleNamespace(exponent=exponent)
    return alg.elementwise(x, lambda h, n: FUNCTIONS["pow"](p, h, n))


def add(alg: Algebra, a: Any, b: Any, *, alpha: Any = 1) -> Traced:
    if alpha != 1:
        b = mul(alg, b, alpha) if isinstance(b, Traced) else b * alpha
    if not isinstance(a, Traced):
        a, b = b, a
    if not isinstance(b, Traced):
        if not isinstance(b, Tensor):  # a number: the value may stay lazy
            return Traced(None, dict(a.coef), lambda: a.value + b)
        b = _constant(b, a, "addition")
        return _fit(Traced(a.value + b, dict(a.coef)))
    _same_rank(a, b, "addition")
    coef = dict(a.coef)
    for k, c in b.coef.items():
        coef[k] = coef[k] + c if k in coef else c
    return _fit(Traced(a.value + b.value, coef))


def neg(alg: Algebra, a: Traced) -> Traced:
    return linear(a, torch.neg)


def sub(alg: Algebra, a: Any, b: Any, *, alpha: Any = 1) -> Traced:
    return add(alg, a, neg(alg, b) if isinstance(b, Traced) else -b, alpha=alpha)


def rsub(alg: Algebra, a: Any, b: Any, *, alpha: Any = 1) -> Traced:
    return sub(alg, b, a, alpha=alpha)


def mul(alg: Algebra, a: Any, b: Any) -> Traced:
    if not isinstance(a, Traced):
        a, b = b, a
    if isinstance(b, Traced):
        _same_rank(a, b, "product")
        return _fit(alg.mul(a, b))
    if not isinstance(b, Tensor):  # a number: no broadcasting, the value may stay lazy
        return linear(a, lambda t: t * b)
    b = _constant(b, a, "product")
    return _fit(linear(a, lambda t: t * b))


def div(alg: Algebra, a: Any, b: Any, *, rounding_mode: Any = None) -> Traced:
    if rounding_mode is not None:
        raise Unsupported("division with rounding is piecewise constant")
    if isinstance(b, Traced):
        return mul(alg, a, power(alg, b, -1.0))
    return mul(alg, a, 1 / b if not isinstance(b, Tensor) else torch.reciprocal(b))


def pow_(alg: Algebra, a: Any, b: Any) -> Traced:
    if isinstance(b, Tensor) and not isinstance(b, Traced) and b.dim() == 0:
        b = float(b)
    if isinstance(a, Traced) and isinstance(b, (int, float)):
        return power(alg, a, float(b))
    if isinstance(b, Traced) and isinstance(a, (int, float)) and a > 0:
        return alg.elementwise(mul(alg, b, math.log(a)), lambda h, n: FUNCTIONS["exp"](None, h, n))
    raise Unsupported("a power whose exponent is a traced tensor or a tensor constant")


def _unary(exponent: float) -> Callable[[Algebra, Traced], Traced]:
    return lambda alg, x: power(alg, x, exponent)


TABLE: dict[Any, Callable[..., Traced]] = {}
_SPELLINGS: list[tuple[tuple[Any, ...], Callable[..., Traced]]] = [
    ((operator.add, torch.add, ("method", "add")), add),
    ((operator.sub, torch.sub, ("method", "sub")), sub),
    ((torch.rsub, ("method", "rsub")), rsub),
    ((operator.mul, torch.mul, ("method", "mul")), mul),
    ((operator.truediv, torch.div, torch.true_divide, ("method", "div"), ("method", "true_divide")), div),
    ((operator.pow, torch.pow, ("method", "pow")), pow_),
    ((operator.neg, torch.neg, ("method", "neg")), neg),
    ((torch.sqrt, ("method", "sqrt")), _unary(0.5)),
    ((torch.rsqrt, ("method", "rsqrt")), _unary(-0.5)),
    ((torch.reciprocal, ("method", "reciprocal")), _unary(-1.0)),
    ((torch.square, ("method", "square")), _unary(2.0)),
]
for spellings, rule in _SPELLINGS:
    for spelling in spellings:
        TABLE[spelling] = rule
