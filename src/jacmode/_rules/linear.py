"""Rules for ``nn.Linear`` (any number of leading dims) and ``nn.Bilinear``-free affine maps.

NOTE: [Linear blocks]
out[..., o] = sum_i W[o, i] a[..., i] + bias[o]. With the leading dims of one sample folded into T,
J_W[b, k] = sum_t G[k, b, t, :] (x) a[b, t, :] and J_bias[b, k] = sum_t G[k, b, t, :]. Without leading
dims (T = 1) the weight block is a plain outer product, written into the result by one broadcast
``torch.mul(..., out=)``; with T > 1 it is a batched matrix product.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .base import Blocks, Rule, batch_view, cotangent_view


class LinearRule(Rule):
    def _factors(self, inputs: tuple[Any, ...], G: Tensor) -> tuple[Tensor, Tensor]:
        a = batch_view(inputs[0], G.shape[1], 1)  # (B, T, I)
        return a, cotangent_view(G, 1)  # (K, B, T, O)

    def per_sample(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Blocks:
        a, g = self._factors(inputs, G)
        blocks: Blocks = {}
        if module.weight is not None:
            if a.shape[1] == 1:
                blocks["weight"] = g[:, :, 0].transpose(0, 1).unsqueeze(-1) * a[:, None, 0, None, :]
            else:
                blocks["weight"] = g.permute(1, 0, 3, 2) @ a.unsqueeze(1)
        if module.bias is not None:
            blocks["bias"] = g.sum(2).transpose(0, 1)
        return blocks

    def write(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, targets: Blocks, accumulate: bool) -> None:
        a, g = self._factors(inputs, G)
        w = targets.get("weight")
        if w is not None and not accumulate and a.shape[1] == 1:
            torch.mul(g[:, :, 0].transpose(0, 1).unsqueeze(-1), a[:, None, 0, None, :], out=w)
        elif w is not None:
            block = g.permute(1, 0, 3, 2) @ a.unsqueeze(1)
            w.add_(block) if accumulate else w.copy_(block)
        b = targets.get("bias")
        if b is not None:
            block = g[:, :, 0] if g.shape[2] == 1 else g.sum(2)
            b.add_(block.transpose(0, 1)) if accumulate else b.copy_(block.transpose(0, 1))


RULES: dict[type, Rule] = {nn.Linear: LinearRule()}
