"""Rules for LayerNorm, RMSNorm, GroupNorm and BatchNorm in eval mode (the affine scale and shift).

NOTE: [Normalisation blocks]
Every such layer is out = xhat * weight + bias with xhat the normalised input, broadcast over the
dims that the parameters do not cover. So J_weight[b, k] = sum over those dims of G[k, b] * xhat[b]
and J_bias[b, k] = the same sum of G[k, b]. xhat is recomputed from the recorded input with the
functional form without affine parameters (one cheap pass). BatchNorm only in eval mode with running
statistics: in training mode it couples the samples of a batch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .base import Blocks, NotCovered, Rule


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
