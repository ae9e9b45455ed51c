"""Taylor rules for pooling, batch norm in eval mode, softmax, log_softmax and the losses, orders 1-4.

The oracle is float64 central finite differences along a direction (Richardson extrapolated),
independent of torch's derivative formulas; each model is checked to take the captured path, so a
test cannot pass by falling back. Max pooling is piecewise: for the differences it is replaced by
the fixed selection it makes at x (a gather, a primitive decomposition equal to f near x), so that
no step crosses a kink; the piecewise losses (l1, smooth l1, Huber) likewise by the branch and
sign each entry takes at x.
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import jacmode as jm

DT = torch.float64


class Frozen(nn.Module):
    """Max pooling that can be replaced by the selection it made at one input (see the module note)."""

    def __init__(self) -> None:
        super().__init__()
        self.record: Optional[dict[str, Tensor]] = None
        self.frozen: Optional[dict[str, Tensor]] = None

    def maxpool(self, h: Tensor, name: str, pool: Callable[[Tensor], Tensor], n: int) -> Tensor:
        if self.frozen is not None:
            idx = self.frozen[name]
            return h.flatten(2).gather(2, idx.flatten(2)).reshape(idx.shape)
        if self.record is not None:
            fn = {1: F.max_pool1d_with_indices, 2: F.max_pool2d_with_indices}[n]
            self.record[name] = fn(h, 2)[1]
        return pool(h)

    def freeze(self, x: Tensor) -> "Frozen":
        self.record = {}
        with torch.no_grad():
            self(x)
        self.frozen, self.record = self.record, None
        return self


class Pools(Frozen):
    """Conv, max pooling (module and F), average pooling, adaptive pooling, log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(2, ceil_mode=True)
        self.out = nn.Linear(3 * 2 * 2 + 3, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x.reshape(-1, 1, 8, 8)))
        a = torch.tanh(self.avg(self.maxpool(h, "f", lambda t: F.max_pool2d(t, 2, stride=2), 2)))  # 8 -> 4 -> 2
        b = F.adaptive_avg_pool2d(self.maxpool(h, "m", self.pool, 2), 1).flatten(1)
        return F.log_softmax(self.out(torch.cat([a.flatten(1), b], 1)), dim=1)


class Normed(Frozen):
    """BatchNorm1d in eval mode, softmax spellings, max_pool1d over features."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn, self.out = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(4, 3)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.normal_()
            self.bn.bias.normal_()
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.sin(self.bn(self.inp(x)))
        h = self.maxpool(h.unsqueeze(1), "f", lambda t: F.max_pool1d(t, 2), 1).squeeze(1)  # (B, 4)
        p = torch.softmax(self.out(h), -1) + h.softmax(dim=1).sum(1, keepdim=True) * nn.Softmax(dim=1)(self.out(h))
        return p * nn.LogSoftmax(dim=1)(self.out(h))


class Losses(Frozen):
    """The per-sample losses of a residual: mse, l1, smooth l1, Huber (F and nn), constant or traced targets."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 6), nn.Linear(6, 3)
        self.huber, self.smooth = nn.HuberLoss(reduction="none", delta=0.4), nn.SmoothL1Loss(reduction="none", beta=0.3)
        self.register_buffer("target", torch.linspace(-0.5, 0.5, 9).reshape(3, 3))  # one row per sample of x

    def piecewise(self, name: str, d: Tensor, delta: float) -> Tensor:
        """huber_delta(d) (|d| for delta = 0) with the branch and sign frozen at x; records them first."""
        if self.frozen is None:
            if self.record is not None:
                self.record[name] = torch.stack([d.abs() < delta, d > 0])
            return d  # unused
        inside, pos = self.frozen[name]
        s = torch.where(pos, 1.0, -1.0).to(d.dtype)
        return torch.where(inside, 0.5 * d * d, delta * (s * d - 0.5 * delta)) if delta > 0 else s * d

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        u, w = self.out(h), torch.sin(x[:, :3])
        if self.frozen is not None or self.record is not None:
            self.piecewise("h", u - w, 0.4), self.piecewise("s", w - u, 0.3), self.piecewise("l", u - self.target, 0.0)
            self.piecewise("z", u - w, 0.0)
        if self.frozen is not None:
            parts = [self.piecewise("h", u - w, 0.4), self.piecewise("s", w - u, 0.3) / 0.3,
                     self.piecewise("l", u - self.target, 0.0), self.piecewise("h", u - w, 0.4) * 2,
                     self.piecewise("z", u - w, 0.0), self.piecewise("z", u - w, 0.0)]
        else:
            parts = [self.huber(u, w), self.smooth(w, u), F.l1_loss(self.target, u, reduction="none"),
                     F.huber_loss(u, w, reduction="none", delta=0.4) * 2,
                     F.smooth_l1_loss(u, w, reduction="none", beta=0.0), nn.L1Loss(reduction="none")(u, w)]
        return F.mse_loss(u, w, reduction="none") + nn.MSELoss(reduction="none")(u, self.target) + sum(parts)


def _fd(f: Callable[[Tensor], Tensor], x: Tensor, v: Tensor, k: int) -> Tensor:
    """d^k/dt^k f(x + t v) at 0 by central differences, Richardson-extrapolated (error O(h^4))."""
    stencils = {1: {1: 0.5, -1: -0.5}, 2: {1: 1.0, 0: -2.0, -1: 1.0},
                3: {2: 0.5, 1: -1.0, -1: 1.0, -2: -0.5}, 4: {2: 1.0, 1: -4.0, 0: 6.0, -1: -4.0, -2: 1.0}}

    def diff(h: float) -> Tensor:
        with torch.no_grad():
            return sum(c * f(x + (s * h) * v) for s, c in stencils[k].items()) / h ** k

    h = {1: 1e-3, 2: 1e-3, 3: 2e-2, 4: 4e-2}[k]  # round-off eps / h^k against truncation h^4
    return (4 * diff(h / 2) - diff(h)) / 3


@pytest.mark.parametrize("cls,dim", [(Pools, 64), (Normed, 5), (Losses, 4)])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_rules_match_finite_differences(cls: Callable[[], nn.Module], dim: int, k: int) -> None:
    torch.manual_seed(0)
    f = cls().double()
    x = torch.randn(3, dim, dtype=DT)
    v = torch.randn(3, 1, dim, dtype=DT) / dim ** 0.5  # one direction per sample
    terms = [(1.0, (0,) * k)]
    assert jm.operator_plan(f, x, terms, directions=v).engine == "collapsed Taylor mode"
    got = jm.operator(f, x, terms, directions=v)
    want = _fd(f.freeze(x), x, v[:, 0], k)
    tol = {1: 1e-6, 2: 1e-5, 3: 1e-3, 4: 1e-3}[k]  # what the differences resolve (a wrong rule is off by O(1))
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    if k == 2 and dim < 10:  # the mixed second order on the coordinate path too: u_01 against a difference of u_0
        u0 = lambda z: jm.partial(f, z, (0,), structure="coupled")  # noqa: E731 -- the frozen f, nested
        e1 = torch.zeros(dim, dtype=DT)
        e1[1] = 1.0
        torch.testing.assert_close(jm.partial(f, x, (0, 1)), _fd(u0, x, e1.expand(3, dim), 1), rtol=1e-5, atol=1e-7)


def test_batch_norm_in_training_mode_is_not_taken_as_independent() -> None:
    f = Normed().double().train()
    x = torch.randn(4, 5, dtype=DT)
    with pytest.raises(jm.CoupledBatchError, match="training"):
        jm.laplacian(f, x)
    with pytest.raises(jm.CoupledBatchError, match="training"):
        jm.operator_plan(f, x, [(1.0, (0,))])
    assert jm.operator_plan(f, x, [(1.0, (0,))], structure="coupled").engine == "nested forward mode"


def test_losses_reduced_over_the_batch_are_refused_and_weights_fall_back() -> None:
    x = torch.randn(4, 3, dtype=DT)
    for reduction in ("mean", "sum"):  # one number for the whole batch: it couples the samples
        with pytest.raises(ValueError, match="keep the batch dimension"):
            jm.laplacian(lambda z, r=reduction: F.huber_loss(torch.tanh(z), z, reduction=r), x)
    weighted = lambda z: F.mse_loss(torch.tanh(z), z, reduction="none", weight=torch.full_like(z, 2.0))  # noqa: E731
    assert jm.operator_plan(weighted, x, [(1.0, (0, 0))]).engine == "nested forward mode"
    want = 2 * jm.laplacian(lambda z: F.mse_loss(torch.tanh(z), z, reduction="none"), x)
    torch.testing.assert_close(jm.laplacian(weighted, x), want)
