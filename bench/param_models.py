"""Model classes for the parameter-Jacobian benchmarks beyond problem 1, written as users write them.

A conv-conv-linear CNN, a residual MLP with GELU and LayerNorm, and a small transformer encoder
layer with a linear head: classes with a ``forward`` and functional calls, not ``nn.Sequential``.
``MODELS`` maps a name to (builder, per-sample input shape, batch size B of its target).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SmallCNN(nn.Module):
    """Conv2d(1, 8, 3) -> ReLU -> Conv2d(8, 8, 3) -> ReLU -> Linear(8 * 28 * 28, 10), on 28 x 28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 28 * 28, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.fc(h.flatten(1))


class ResidualMLP(nn.Module):
    """Linear(16, 64), two pre-norm residual blocks (LayerNorm, Linear, GELU), Linear(64, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.norm1, self.block1 = nn.LayerNorm(64), nn.Linear(64, 64)
        self.norm2, self.block2 = nn.LayerNorm(64), nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + F.gelu(self.block1(self.norm1(h)))
        h = h + F.gelu(self.block2(self.norm2(h)))
        return self.out(h)


class TinyTransformer(nn.Module):
    """nn.TransformerEncoderLayer(32, 4 heads, 64, batch_first) over 8 tokens, mean-pooled, Linear(32, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x).mean(dim=1))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "cnn": (SmallCNN, (1, 28, 28), 64),
    "residual-mlp": (ResidualMLP, (16,), 256),
    "transformer": (TinyTransformer, (8, 32), 32),
}


def make(name: str, seed: int = 0) -> tuple[nn.Module, Tensor]:
    """The model (eval mode) and its batch of B inputs.

    Example:
        >>> model, x = make("residual-mlp")
        >>> tuple(x.shape), tuple(model(x).shape)
        ((256, 16), (256, 10))
    """
    build, shape, batch = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build().eval()
        x = torch.rand(batch, *shape)
    return model, x
