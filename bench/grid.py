"""The grids of shapes that calibrate and judge the cost model (see ``bench.calibrate``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


class _MeanTokens(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(dim=-2)


class _Opaque(nn.Module):
    """A module jacmode cannot see through: the generic (vmap) engines, never the layer-wise ones.

    The Python branch on the input's rank is what torch.fx cannot trace, so no graph is captured.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self._jacmode_no_probes = True  # no layer-wise probes either

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise ValueError("expected a batch")
        return self.net(x)


@dataclass(frozen=True)
class Case:
    """One point of a grid: a model, a batch, what to differentiate."""

    family: str  # "mlp", "mlp-opaque" (same, generic engines), "ew" (elementwise-heavy), "cnn", "seq" (tokens)
    d: int  # input features (mlp) or image side (cnn, 1 channel)
    y: int  # outputs
    b: int  # batch
    wrt: Any = "inputs"  # "inputs", "params" or a list of names
    h: int = 32  # hidden width
    h0: Optional[int] = None  # first hidden width (mlp), h if None

    def build(self) -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        if self.family == "seq":
            model = nn.Sequential(nn.Linear(self.d, self.h), nn.Tanh(), _MeanTokens(), nn.Linear(self.h, self.y))
            return model, torch.randn(self.b, 64, self.d)
        if self.family == "ew":
            model = nn.Sequential(nn.Linear(self.d, 4), nn.Tanh(), nn.Linear(4, self.y), nn.Tanh(), nn.Sigmoid())
            return model, torch.randn(self.b, self.d)
        if self.family in ("mlp", "mlp-opaque"):
            h0 = self.h0 or self.h
            model = nn.Sequential(nn.Linear(self.d, h0), nn.Tanh(), nn.Linear(h0, self.h), nn.Tanh(),
                                  nn.Linear(self.h, self.y))
            return (model if self.family == "mlp" else _Opaque(model)), torch.randn(self.b, self.d)
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                              nn.ReLU(), nn.Flatten(), nn.Linear(4 * self.d * self.d, self.y))
        return model, torch.randn(self.b, 1, self.d, self.d)

    @property
    def label(self) -> str:
        wrt = self.wrt if isinstance(self.wrt, str) else "+".join(self.wrt)
        return f"{self.family} d={self.d} y={self.y} h={self.h}{'' if self.h0 is None else f'/{self.h0}'} B={self.b} wrt={wrt}"


def _axes(case: Case) -> tuple[int, int]:
    """(N, Y) of a case."""
    import jacmode as jm

    model, x = case.build()
    p = jm.plan(model, x[:1], wrt=case.wrt, mode="forward")
    return (p.directions, case.y)


def fit_grid() -> list[Case]:
    """The grid the constants are fitted on."""
    cases = []
    for b in (1, 16, 128, 1024):
        for d, y in ((1, 1), (1, 100), (10, 100), (100, 100), (100, 10), (100, 1), (3, 30), (30, 3)):
            cases.append(Case("mlp", d, y, b))
        for d, y in ((10, 30), (30, 10)):
            cases.append(Case("mlp", d, y, b, h=64))
        for side, y in ((4, 1), (4, 16), (4, 256), (10, 1), (10, 100)):
            if b <= 128:
                cases.append(Case("cnn", side, y, b))
        for y, wrt, h0 in ((100, ["0.bias"], 1), (300, ["0.bias"], 3), (100, ["2.bias"], None),
                           (10, ["4.bias"], None), (10, "params", None), (1, "params", None), (3, ["2.bias"], None)):
            if b * y <= 32768:
                cases.append(Case("mlp", 4, y, b, wrt=wrt, h=16, h0=h0))
        for y, wrt in ((1, "params"), (30, ["0.weight", "0.bias"]), (300, ["0.bias"])):
            if b <= 128:
                cases.append(Case("cnn", 6, y, b, wrt=wrt))
        for d, y in ((1, 300), (1, 1000), (300, 1), (1000, 1), (30, 30), (100, 300)):
            if b * max(d, y) ** 2 <= 3 * 10**7:
                cases.append(Case("ew", d, y, b))
        if b <= 128:
            cases.append(Case("ew", 4, 300, b, wrt=["2.bias"]))
    return cases


def regret_grid() -> list[Case]:
    """The grid ``mode="auto"`` is judged on: other widths and sizes than the fit grid."""
    cases = []
    for b in (1, 8, 64, 512, 1024):
        for d, y in ((2, 200), (20, 60), (60, 20), (200, 2), (50, 50)):
            cases.append(Case("mlp", d, y, b, h=48))
        for d, y in ((2, 500), (500, 2)):
            if b <= 64:
                cases.append(Case("ew", d, y, b))
        if b <= 512:
            for y, wrt, h0 in ((200, ["0.bias"], 2), (20, ["2.bias"], None), (2, "params", None)):
                cases.append(Case("mlp", 6, y, b, wrt=wrt, h=24, h0=h0))
        if b <= 64:
            for side, y, wrt in ((6, 2, "inputs"), (6, 200, "inputs"), (8, 5, "params"), (8, 150, ["0.bias"])):
                cases.append(Case("cnn", side, y, b, wrt=wrt))
    return cases


def probe_grid() -> list[Case]:
    """The grid the probe engine's constants are fitted on: per-sample parameter Jacobians of MLPs
    and a small CNN (every parameter covered by a rule), all parameters or one layer's weight or
    bias (first, middle, last: from the longest reverse pass to none), Y from 1 to 300, B from 1 to 1024."""
    cases = []
    subsets = ("params", ["0.weight"], ["0.bias"], ["2.weight", "2.bias"], ["4.weight"], ["4.bias"])
    for b in (1, 16, 128, 1024):
        for d, y, h in ((4, 1, 16), (4, 10, 16), (30, 3, 64), (8, 100, 32), (100, 30, 128), (2, 300, 16)):
            for wrt in subsets:
                case = Case("mlp", d, y, b, wrt=wrt, h=h)
                n = {"params": d * h + h + h * h + h + h * y + y, "0.weight": d * h, "0.bias": h, "2.weight": h * h + h,
                     "4.weight": h * y, "4.bias": y}[wrt if isinstance(wrt, str) else wrt[0]]
                if b * y * n <= 2 * 10**7:
                    cases.append(case)
        for y, wrt in ((1, "params"), (30, ["0.weight", "0.bias"]), (300, ["0.bias"]), (30, ["5.weight"]),
                       (100, ["5.bias"])):
            if b <= 128:
                cases.append(Case("cnn", 6, y, b, wrt=wrt))
    return cases
