"""Rules for maps linear in their traced input: Linear, matmul with a constant, convolutions, sums.

Each maps every Taylor coefficient with the map itself, without the bias (``base.linear``).
Convolutions see the directions and the batch as one batch (``base.merged``). Sums and means
must leave the batch dimension alone, or they would mix samples.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Algebra, Traced, Unsupported, feature_dim, linear, merged


def _traced(x: Any, what: str) -> Traced:
    if not isinstance(x, Traced):
        raise Unsupported(f"{what} with a traced weight")
    return x


def _plain(*weights: Any) -> None:
    if any(isinstance(w, Traced) for w in weights):
        raise Unsupported("a weight that depends on the input")


def linear_module(alg: Algebra, m: nn.Linear, x: Traced) -> Traced:
    return linear(x, lambda v: F.linear(v, m.weight, m.bias), lambda c: F.linear(c, m.weight))


def linear_fn(alg: Algebra, x: Any, weight: Any, bias: Any = None) -> Traced:
    x = _traced(x, "F.linear")
    _plain(weight, bias)
    return linear(x, lambda v: F.linear(v, weight, bias), lambda c: F.linear(c, weight))


def matmul(alg: Algebra, x: Any, w: Any) -> Traced:
    if not isinstance(x, Traced) or isinstance(w, Traced) or x.value.dim() < 2 or w.dim() > 2:
        raise Unsupported("matmul other than (B, ..., D) @ a constant (D,) or (D, H)")
    return linear(x, lambda t: t @ w)


def conv_module(alg: Algebra, m: Any, x: Traced) -> Traced:
    return linear(x, m, merged(lambda t: m._conv_forward(t, m.weight, None)))


def _conv_fn(conv: Callable[..., Tensor]) -> Callable[..., Traced]:
    def rule(alg: Algebra, x: Any, weight: Any, bias: Any = None, *args: Any, **kwargs: Any) -> Traced:
        x = _traced(x, conv.__name__)
        _plain(weight, bias)
        return linear(x, lambda v: conv(v, weight, bias, *args, **kwargs),
                      merged(lambda t: conv(t, weight, None, *args, **kwargs)))

    return rule


def _dims(dim: Any, rank: int, what: str) -> Optional[tuple[int, ...]]:
    if dim is None:
        raise Unsupported(f"{what} over all dimensions mixes the samples of the batch")
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(feature_dim(d, rank, what) for d in dims)


def _reduction(fn: Callable[..., Tensor], what: str) -> Callable[..., Traced]:
    def rule(alg: Algebra, x: Traced, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Traced:
        if dtype is not None:
            raise Unsupported(f"{what} with a dtype")
        dims = _dims(dim, x.value.dim(), what)
        return linear(x, lambda v: fn(v, dim, keepdim), lambda c: fn(c, dims, keepdim))

    return rule


TABLE: dict[Any, Callable[..., Traced]] = {nn.Linear: linear_module, F.linear: linear_fn}
for spelling in (torch.matmul, operator.matmul, ("method", "matmul"), torch.mm, ("method", "mm")):
    TABLE[spelling] = matmul
for module in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    TABLE[module] = conv_module
for conv in (F.conv1d, F.conv2d, F.conv3d):
    TABLE[conv] = _conv_fn(conv)
for name, reduce in (("sum", torch.sum), ("mean", torch.mean)):
    TABLE[reduce] = TABLE[("method", name)] = _reduction(reduce, f"torch.{name}")
