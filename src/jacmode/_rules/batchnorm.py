"""Taylor rule for batch normalisation in eval mode: an affine map per channel.

With running statistics and ``training=False``, y = (x - mean) / sqrt(var + eps) * weight + bias
over channel dimension 1: linear in x, so every coefficient is scaled per channel and the shift
goes to the value only. In training mode (or without running statistics) the batch statistics
couple the samples: the rule refuses, and the call takes the generic engine, whose coupling check
reports it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Algebra, Traced, Unsupported, linear


def batch_norm(alg: Algebra, x: Any, running_mean: Optional[Tensor], running_var: Optional[Tensor],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Traced:
    if not isinstance(x, Traced) or any(isinstance(t, Traced) for t in (running_mean, running_var, weight, bias)):
        raise Unsupported("batch_norm with traced statistics or weights")
    if training or running_mean is None or running_var is None:
        raise Unsupported("batch_norm with batch statistics (training mode) couples the samples")
    if x.value.dim() < 2:
        raise Unsupported("batch_norm of an unbatched input")
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    shape = (-1,) + (1,) * (x.value.dim() - 2)  # channel dim 1 of the value, 2 of a coefficient

    def value(v: Tensor) -> Tensor:
        return F.batch_norm(v, running_mean, running_var, weight, bias, False, momentum, eps)

    return linear(x, value, lambda c: c * scale.reshape(shape))


def batch_norm_module(alg: Algebra, m: nn.modules.batchnorm._BatchNorm, x: Any) -> Traced:
    if m.training or not m.track_running_stats:
        raise Unsupported(f"{type(m).__name__} in training mode couples the samples")
    return batch_norm(alg, x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)


TABLE: dict[Any, Callable[..., Traced]] = {
    F.batch_norm: batch_norm,
    nn.BatchNorm1d: batch_norm_module, nn.BatchNorm2d: batch_norm_module, nn.BatchNorm3d: batch_norm_module,
}
