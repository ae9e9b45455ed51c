"""Taylor rules for softmax and log_softmax over a feature dimension, written with the other rules.

log_softmax(x) = (x - c) - log(sum(exp(x - c))) for any constant c, so c = max(x) (the value's,
held constant: the function does not depend on it) keeps exp from overflowing, and the rule is the
composition of a difference, exp, a sum over the dimension, log and a difference: every derivative
order follows from those rules, none is written here. softmax(x) = exp(log_softmax(x)).
The dimension must not be the batch (that would mix samples); a ``dtype`` other than the input's
is left to the generic engine.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import arithmetic
from .base import Algebra, Traced, Unsupported, feature_dim, linear
from .elementwise import FUNCTIONS


def _exp(alg: Algebra, x: Traced) -> Traced:
    return alg.elementwise(x, lambda h, n: FUNCTIONS["exp"](None, h, n))


def _log(alg: Algebra, x: Traced) -> Traced:
    return alg.elementwise(x, lambda h, n: FUNCTIONS["log"](None, h, n))


def log_softmax(alg: Algebra, x: Any, dim: Optional[int] = None, _stacklevel: int = 3,
                dtype: Optional[torch.dtype] = None) -> Traced:
    if not isinstance(x, Traced):
        raise Unsupported("log_softmax of a traced dimension")
    if dim is None:
        raise Unsupported("softmax without dim (an implicit, deprecated choice)")
    if dtype is not None and dtype != x.value.dtype:
        raise Unsupported("softmax with a dtype cast")
    rank = x.value.dim()
    d = feature_dim(dim, rank, "softmax")
    shift = x.value.detach().amax(dim, keepdim=True)
    centred = arithmetic.sub(alg, x, shift)
    total = linear(_exp(alg, centred), lambda v: v.sum(dim, keepdim=True), lambda c: c.sum(d, keepdim=True))
    return arithmetic.sub(alg, centred, _log(alg, total))


def softmax(alg: Algebra, x: Any, dim: Optional[int] = None, _stacklevel: int = 3,
            dtype: Optional[torch.dtype] = None) -> Traced:
    return _exp(alg, log_softmax(alg, x, dim, _stacklevel, dtype))


def _method(rule: Callable[..., Traced]) -> Callable[..., Traced]:
    return lambda alg, x, dim=None, dtype=None: rule(alg, x, dim, 3, dtype)


TABLE: dict[Any, Callable[..., Traced]] = {
    F.softmax: softmax, F.log_softmax: log_softmax,
    torch.softmax: _method(softmax), torch.log_softmax: _method(log_softmax),
    ("method", "softmax"): _method(softmax), ("method", "log_softmax"): _method(log_softmax),
    nn.Softmax: lambda alg, m, x: softmax(alg, x, m.dim), nn.LogSoftmax: lambda alg, m, x: log_softmax(alg, x, m.dim),
}
