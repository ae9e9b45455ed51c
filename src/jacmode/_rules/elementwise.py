"""Derivatives of any order of the elementwise activations that the Taylor fast path knows.

``jet(layer, h, n)`` describes ``y = s(h)`` for an activation module ``layer`` applied to
pre-activations ``h``, up to the n-th derivative, as a :class:`Jet`: the value, a fused product
``first(t) = s'(h) t``, and factors for the higher derivatives. Everything is made of plain torch
operations, hence differentiable with respect to ``h`` (and so with respect to the parameters and
inputs that ``h`` depends on).

NOTE: [Derivatives of activations]
tanh and the logistic sigmoid satisfy y' = c(y) for a quadratic c (1 - y^2 and y - y^2), so every
derivative is a polynomial in y: P_1 = c, P_(m+1) = P_m'(y) c(y), and s^(m) / s' = P_(m-1)'(y) is a
polynomial too. Their jets are "inside": a derivative coefficient y_K = s' h_K + sum_m s^(m) (...)
is computed as first(h_K + sum_m [s^(m) / s'] (...)) with torch's fused ``tanh_backward`` /
``sigmoid_backward`` kernels, the cheapest form (these are also what backprop runs).
softplus(h) = log(1 + exp(beta h)) / beta has derivatives beta^(m-1) sigmoid^(m-1)(beta h) and,
like torch, is linear where beta h > threshold. SiLU (h sigmoid(h)) and exact GELU (h Phi(h)) are
h g(h) with m-th derivative h g^(m) + m g^(m-1); for GELU, Phi^(j) = (-1)^(j-1) He_(j-1)(h) phi(h)
with the probabilists' Hermite polynomials He. ReLU and LeakyReLU have no curvature. Nothing is
computed beyond the order asked for.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Jet:
    """``y = s(h)`` to order n: ``value``, ``first(t) = s'(h) t``, and ``higher[m]`` for m >= 2.

    With ``inside`` the higher factors are s^(m) / s' and go inside ``first``; otherwise they are
    s^(m) and are added outside. ``higher[m]`` is None where s^(m) is zero everywhere.
    """

    value: Tensor
    first: Callable[[Tensor], Tensor]
    higher: list[Optional[Tensor]]  # indices 0 and 1 unused
    inside: bool
    scale: Optional[list[float]] = None  # higher[m] stands for scale[m] * higher[m] (saves a pass)


Poly = tuple[float, ...]  # coefficients of y^0, y^1, ...


def _mul(p: Poly, q: Poly) -> Poly:
    out = [0.0] * (len(p) + len(q) - 1)
    for i, a in enumerate(p):
        for j, b in enumerate(q):
            out[i + j] += a * b
    return tuple(out)


def _diff(p: Poly) -> Poly:
    return tuple(i * a for i, a in enumerate(p))[1:] or (0.0,)


@functools.lru_cache(maxsize=None)
def _ratio(c: Poly, m: int) -> Poly:
    """s^(m) / s' as a polynomial in y, for y' = c(y) and m >= 2."""
    p = c
    for _ in range(m - 2):
        p = _mul(_diff(p), c)
    return _diff(p)


def _horner(p: Poly, y: Tensor) -> Tensor:
    """p(y) by Horner's rule, skipping multiplications and additions by zero."""
    out: Union[float, Tensor] = 0.0
    for a in reversed(p):
        if isinstance(out, Tensor) or out != 0.0:
            out = out * y
        if a != 0.0:
            out = out + a
    return out if isinstance(out, Tensor) else torch.full_like(y, out)


def _quadratic(y: Tensor, c: Poly, backward: Callable[[Tensor, Tensor], Tensor], n: int) -> Jet:
    higher: list[Optional[Tensor]] = [None, None]
    scale = [1.0, 1.0]
    for m in range(2, n + 1):
        p = _ratio(c, m)
        if len([a for a in p if a != 0.0]) == 1 and p[-1] != 0.0 and len(p) == 2:  # a y: y, scale a
            higher.append(y)
            scale.append(p[-1])
        else:
            higher.append(_horner(p, y))
            scale.append(1.0)
    return Jet(y, lambda t: backward(t, y), higher, inside=True, scale=scale)


def _tanh(layer: nn.Module, h: Tensor, n: int) -> Jet:
    return _quadratic(torch.tanh(h), (1.0, 0.0, -1.0), torch.ops.aten.tanh_backward, n)


def _sigmoid(layer: nn.Module, h: Tensor, n: int) -> Jet:
    return _quadratic(torch.sigmoid(h), (0.0, 1.0, -1.0), torch.ops.aten.sigmoid_backward, n)


def _explicit(value: Tensor, derivs: list[Optional[Tensor]]) -> Jet:
    """A jet from the list [s', s'', ...] of explicit derivatives."""
    d1 = derivs[0]
    assert d1 is not None
    return Jet(value, lambda t: t * d1, [None, None, *derivs[1:]], inside=False)


def _sigmoid_derivs(h: Tensor, n: int) -> list[Tensor]:
    """sigmoid and its derivatives 0..n."""
    s = torch.sigmoid(h)
    c = (0.0, 1.0, -1.0)
    out = [s] + ([s - s * s] if n >= 1 else [])
    for m in range(2, n + 1):
        out.append(out[1] * _horner(_ratio(c, m), s))
    return out


def _softplus(layer: nn.Module, h: Tensor, n: int) -> Jet:
    beta, threshold = float(getattr(layer, "beta")), float(getattr(layer, "threshold"))
    linear = h * beta > threshold
    s = _sigmoid_derivs(h * beta, max(0, n - 1))
    derivs: list[Optional[Tensor]] = [torch.where(linear, torch.ones_like(h), s[0])]
    derivs += [torch.where(linear, torch.zeros_like(h), beta ** (m - 1) * s[m - 1]) for m in range(2, n + 1)]
    return _explicit(F.softplus(h, beta, threshold), derivs)


def _times_h(h: Tensor, g: list[Tensor], value: Tensor) -> Jet:
    """The jet of h * g(h) from g and its derivatives 0..n."""
    return _explicit(value, [h * g[m] + m * g[m - 1] for m in range(1, len(g))])


def _silu(layer: nn.Module, h: Tensor, n: int) -> Jet:
    return _times_h(h, _sigmoid_derivs(h, n), F.silu(h))


def _gelu(layer: nn.Module, h: Tensor, n: int) -> Jet:
    phi = torch.exp(-0.5 * h * h) * (1 / math.sqrt(2 * math.pi))
    cdf = [0.5 * (1 + torch.erf(h * (1 / math.sqrt(2)))), phi]
    hermite = [torch.ones_like(h), h]  # He_0, He_1, ...; He_(k+1) = h He_k - k He_(k-1)
    for j in range(2, n + 1):
        if j - 1 >= len(hermite):
            hermite.append(h * hermite[-1] - (len(hermite) - 1) * hermite[-2])
        cdf.append((-1) ** (j - 1) * hermite[j - 1] * phi)
    return _times_h(h, cdf[: n + 1], F.gelu(h))


def _piecewise_linear(value: Tensor, slope: Tensor, n: int) -> Jet:
    return _explicit(value, [slope] + [None] * max(0, n - 1))


def _relu(layer: nn.Module, h: Tensor, n: int) -> Jet:
    return _piecewise_linear(torch.relu(h), (h > 0).to(h.dtype), n)


def _leaky_relu(layer: nn.Module, h: Tensor, n: int) -> Jet:
    slope = float(getattr(layer, "negative_slope"))
    slopes = torch.where(h > 0, torch.ones_like(h), torch.full_like(h, slope))
    return _piecewise_linear(F.leaky_relu(h, slope), slopes, n)


def _identity(layer: nn.Module, h: Tensor, n: int) -> Jet:
    return Jet(h, lambda t: t, [None] * (n + 1), inside=False)


def _derivs(value: Tensor, n: int, d: Callable[[int], Optional[Tensor]]) -> Jet:
    return _explicit(value, [d(m) for m in range(1, max(n, 1) + 1)])


def _exp(layer: object, h: Tensor, n: int) -> Jet:
    e = torch.exp(h)
    return _derivs(e, n, lambda m: e)


def _log(layer: object, h: Tensor, n: int) -> Jet:
    inv = torch.reciprocal(h)
    return _derivs(torch.log(h), n, lambda m: (-1) ** (m - 1) * math.factorial(m - 1) * inv ** m)


def _sin(layer: object, h: Tensor, n: int) -> Jet:
    s, c = torch.sin(h), torch.cos(h)
    return _derivs(s, n, lambda m: (c, -s, -c, s)[(m - 1) % 4])


def _cos(layer: object, h: Tensor, n: int) -> Jet:
    s, c = torch.sin(h), torch.cos(h)
    return _derivs(c, n, lambda m: (-s, -c, s, c)[(m - 1) % 4])


def _power(layer: object, h: Tensor, n: int) -> Jet:
    """h ** c for a constant c: c (c - 1) ... (c - m + 1) h ** (c - m); zero beyond an integer c >= 0."""
    c = float(getattr(layer, "exponent"))

    def d(m: int) -> Optional[Tensor]:
        factor = math.prod(c - i for i in range(m))
        if factor == 0.0:
            return None
        return factor * (torch.ones_like(h) if c - m == 0 else h ** (c - m))

    return _derivs(h ** c, n, d)


def _abs(layer: object, h: Tensor, n: int) -> Jet:
    return _piecewise_linear(torch.abs(h), torch.sign(h), n)


def _elu(layer: object, h: Tensor, n: int) -> Jet:
    alpha, scale = float(getattr(layer, "alpha", 1.0)), float(getattr(layer, "scale", 1.0))
    pos, ae = h > 0, scale * alpha * torch.exp(torch.clamp(h, max=0.0))
    first = torch.where(pos, torch.full_like(h, scale), ae)
    rest = torch.where(pos, torch.zeros_like(h), ae) if n >= 2 else None
    value = scale * torch.where(pos, h, alpha * torch.expm1(torch.clamp(h, max=0.0)))
    return _derivs(value, n, lambda m: first if m == 1 else rest)


def _hardtanh(layer: object, h: Tensor, n: int) -> Jet:
    lo, hi = float(getattr(layer, "min_val", -1.0)), float(getattr(layer, "max_val", 1.0))
    return _piecewise_linear(torch.clamp(h, lo, hi), ((h > lo) & (h < hi)).to(h.dtype), n)


SELU = {"alpha": 1.6732632423543772848170429916717, "scale": 1.0507009873554804934193349852946}

JetFn = Callable[[Any, Tensor, int], Jet]

# name -> jet; every spelling (module, torch.*, F.*, Tensor method) is mapped to a name in _rules/table.py
FUNCTIONS: dict[str, JetFn] = {
    "tanh": _tanh, "sigmoid": _sigmoid, "silu": _silu, "softplus": _softplus, "relu": _relu,
    "leaky_relu": _leaky_relu, "gelu": _gelu, "identity": _identity, "exp": _exp, "log": _log,
    "sin": _sin, "cos": _cos, "pow": _power, "abs": _abs, "elu": _elu, "hardtanh": _hardtanh,
}

RULES: dict[type, Callable[[nn.Module, Tensor, int], Jet]] = {
    nn.Tanh: _tanh,
    nn.Sigmoid: _sigmoid,
    nn.SiLU: _silu,
    nn.Softplus: _softplus,
    nn.ReLU: _relu,
    nn.LeakyReLU: _leaky_relu,
    nn.GELU: _gelu,
    nn.Identity: _identity,
}


def rule(layer: nn.Module) -> Optional[Callable[[nn.Module, Tensor, int], Jet]]:
    """The jet rule of an activation module, or None if the fast path does not know it."""
    found = RULES.get(type(layer))
    if found is _gelu and getattr(layer, "approximate", "none") != "none":
        return None
    return found


def jet(layer: nn.Module, h: Tensor, n: int) -> Jet:
    """The :class:`Jet` of the activation ``layer`` at ``h`` up to order ``n`` (see the note)."""
    found = rule(layer)
    if found is None:
        raise TypeError(f"no derivative rule for {type(layer).__name__}")  # callers check rule()
    return found(layer, h, n)


def combine(j: Jet, lower: Optional[Tensor], terms: list[tuple[int, Tensor]]) -> Optional[Tensor]:
    """s' lower + sum over (m, product) in terms of s^(m) product; None when it is zero."""
    extra = lower if j.inside else None  # inside: s' (lower + sum of s^(m)/s' products), fused
    for m, product in terms:
        factor = j.higher[m]
        if factor is not None:
            a = 1.0 if j.scale is None else j.scale[m]
            if extra is None:
                extra = factor * product if a == 1.0 else factor * (a * product)
            else:
                extra = torch.addcmul(extra, factor, product, value=a)
    if j.inside:
        return None if extra is None else j.first(extra)
    out = None if lower is None else j.first(lower)
    return extra if out is None else out if extra is None else out + extra
