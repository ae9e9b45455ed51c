"""Compiled Taylor code (Inductor, ``compile=True``) on drawn tanh/sigmoid networks and operators,
against float64 torch.func oracles: the rewrites of compiled code (folded directions, blocked
square sums, the spelled-out tanh of [Tanh in compiled code]) must keep every result exact to
float32 rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import jacmode as jm
from tests.test_compile import _has_compiler

pytestmark = [pytest.mark.compile, pytest.mark.skipif(not _has_compiler(), reason="no C++ compiler for inductor")]


class _Net(nn.Module):
    def __init__(self, d: int, h: int, depth: int, act: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, h) for a in [d] + [h] * (depth - 1))
        self.out = nn.Linear(h, 2)
        self.act = act

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) if self.act == "tanh" else torch.sigmoid(layer(x))
        return self.out(x)


def _hessians(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, Y, D, D) in float64 by torch.func."""
    return torch.func.vmap(torch.func.hessian(lambda z: net(z[None])[0]))(x)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.integers(1, 4), h=st.integers(2, 12), depth=st.integers(1, 3), act=st.sampled_from(["tanh", "sigmoid"]),
       batch=st.integers(1, 40), scale=st.sampled_from([0.1, 1.0, 4.0]), seed=st.integers(0, 2**16))
def test_compiled_operators_match_float64_oracles(d, h, depth, act, batch, scale, seed):
    torch.manual_seed(seed)
    net = _Net(d, h, depth, act)
    x = scale * torch.randn(batch, d)
    lap = jm.transform(jm.laplacian, net, compile=True)(x)
    parts = jm.transform(jm.partials, net, dims=[(0,), (0, 0)], compile=True)(x)
    hess = _hessians(net.double(), x.double())
    grads = torch.func.vmap(torch.func.jacrev(lambda z: net(z[None])[0]))(x.double())
    tol = dict(rtol=1e-4, atol=1e-5 * max(1.0, float(hess.abs().max()), float(grads.abs().max())))
    torch.testing.assert_close(lap.double(), hess.diagonal(dim1=-2, dim2=-1).sum(-1), **tol)
    torch.testing.assert_close(parts[0].double(), grads[..., 0], **tol)
    torch.testing.assert_close(parts[1].double(), hess[..., 0, 0], **tol)
