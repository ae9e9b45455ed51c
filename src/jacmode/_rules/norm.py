"""Rules for normalisation layers: LayerNorm (both engines); RMSNorm, GroupNorm, BatchNorm in eval mode.

Taylor rules (input derivatives): LayerNorm is written with the other rules (mean, difference,
product, power), so it needs no derivatives of its own: y = (x - mean(x)) * (mean((x - mean(x))^2)
+ eps)^(-1/2) * w + b, the means over the normalised (trailing) dimensions of each sample.

NOTE: [Normalisation blocks]
For the probe engine, every such layer is out = xhat * weight + bias with xhat the normalised input,
broadcast over the dims that the parameters do not cover. So J_weight[b, k] = sum over those dims of
G[k, b] * xhat[b] and J_bias[b, k] = the same sum of G[k, b]. xhat is recomputed from the recorded
input with the functional form without affine parameters (one cheap pass). BatchNorm only in eval
mode with running statistics: in training mode it couples the samples of a batch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import arithmetic
from .base import Algebra, Blocks, NotCovered, Rule, Traced, Unsupported, linear


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


# Parameter rules (the probe engine)


class _AffineRule(Rule):
    """out = xhat * weight + bias; subclasses give xhat and the layout of the parameter dims."""

    def xhat(self, module: Any, a: Tensor) -> Tensor:
        raise NotImplementedError

    def channel_dim(self, module: Any) -> Optional[int]:
        """None: parameters cover the trailing dims (LayerNorm); 1: one value per channel."""
        return None

    def per_sample(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Blocks:
        a, (K, B) = inputs[0], G.shape[:2]
        if a.shape[0] != B:
            raise NotCovered(f"normalisation input {tuple(a.shape)} is not batched by the {B} samples")
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        shape = next(p.shape for p in (weight, bias) if p is not None)

        def reduce(t: Tensor) -> Tensor:  # (K, B, ...) -> (B, K, *shape)
            if self.channel_dim(module) is None:
                t = t.reshape(K, B, -1, *shape).sum(2)
            else:
                t = t.reshape(K, B, shape[0], -1).sum(-1)
            return t.transpose(0, 1)

        blocks: Blocks = {}
        if weight is not None:
            blocks["weight"] = reduce(G * self.xhat(module, a))
        if bias is not None:
            blocks["bias"] = reduce(G)
        return blocks


class LayerNormRule(_AffineRule):
    def xhat(self, module: Any, a: Tensor) -> Tensor:
        return F.layer_norm(a, module.normalized_shape, None, None, module.eps)


class RMSNormRule(_AffineRule):
    def xhat(self, module: Any, a: Tensor) -> Tensor:
        return F.rms_norm(a, module.normalized_shape, None, module.eps)


class GroupNormRule(_AffineRule):
    def xhat(self, module: Any, a: Tensor) -> Tensor:
        return F.group_norm(a, module.num_groups, None, None, module.eps)

    def channel_dim(self, module: Any) -> Optional[int]:
        return 1


class BatchNormRule(_AffineRule):
    def unsupported(self, module: nn.Module) -> Optional[str]:
        if module.training or getattr(module, "running_mean", None) is None:
            return "BatchNorm in training mode (or without running statistics) couples the samples"
        return None

    def xhat(self, module: Any, a: Tensor) -> Tensor:
        shape = (1, -1) + (1,) * (a.dim() - 2)
        mean, var = module.running_mean.view(shape), module.running_var.view(shape)
        return (a - mean) * (var + module.eps).rsqrt()

    def channel_dim(self, module: Any) -> Optional[int]:
        return 1


RULES: dict[type, Rule] = {
    nn.LayerNorm: LayerNormRule(),
    nn.GroupNorm: GroupNormRule(),
    nn.BatchNorm1d: BatchNormRule(),
    nn.BatchNorm2d: BatchNormRule(),
    nn.BatchNorm3d: BatchNormRule(),
}
if hasattr(nn, "RMSNorm") and hasattr(F, "rms_norm"):  # torch >= 2.4
    RULES[nn.RMSNorm] = RMSNormRule()
