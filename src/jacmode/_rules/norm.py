"""Rules for normalisation over the features of each sample: LayerNorm.

LayerNorm is written with the other rules (mean, difference, product, power), so it needs no
derivatives of its own: y = (x - mean(x)) * (mean((x - mean(x))^2) + eps)^(-1/2) * w + b, the
means over the normalised (trailing) dimensions of each sample.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from . import arithmetic
from .base import Algebra, Traced, Unsupported, linear


def layer_norm(alg: Algebra, x: Any, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5) -> Traced:
    if not isinstance(x, Traced) or isinstance(weight, Traced) or isinstance(bias, Traced):
        raise Unsupported("layer_norm with traced weights")
    n = len(tuple(normalized_shape))
    if n >= x.value.dim():
        raise Unsupported("layer_norm over the batch dimension mixes the samples")
    dims = tuple(range(-n, 0))

    def mean(t: Traced) -> Traced:
        return linear(t, lambda v: v.mean(dims, keepdim=True))

    centred = arithmetic.sub(alg, x, mean(x))
    var = mean(alg.mul(centred, centred))
    y = arithmetic.mul(alg, centred, arithmetic.power(alg, arithmetic.add(alg, var, eps), -0.5))
    if weight is not None:
        y = arithmetic.mul(alg, y, weight)
    if bias is not None:
        y = arithmetic.add(alg, y, bias)
    return y


def layer_norm_module(alg: Algebra, m: nn.LayerNorm, x: Traced) -> Traced:
    return layer_norm(alg, x, m.normalized_shape, m.weight, m.bias, m.eps)


TABLE: dict[Any, Callable[..., Traced]] = {
    nn.LayerNorm: layer_norm_module,
    torch.nn.functional.layer_norm: layer_norm,
    torch.layer_norm: layer_norm,
}
