"""Fit the NTK cost model of ``jm.ntk(method="auto")``, report its regret, plot the crossover.

``python -m bench.calibrate_ntk [--write] [--plot PNG] [--table MD]`` times every method
on a grid of model classes (wide P, wide Y, deep, convolutional, a weight used outside its module)
with one thread, fits the three constants of each method (non-negative least squares on the log of
predicted over measured time, as for the Jacobian engines; see ``_planning/ntk.py``), prints the regret of "auto" (its time over the fastest method's) per shape,
and with ``--write`` stores the constants in ``jacmode/_planning/calibrated.json``. A few minutes on one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor, nn

import jacmode as jm
from jacmode._planning import ntk as model_ntk
from bench.baselines import MLP
from bench.calibrate import nnls_log
from bench.timing import median_ms


class Deep(nn.Module):
    """A deep, narrow class with functional tanh."""

    def __init__(self, d: int = 8, width: int = 48, depth: int = 6, y: int = 4) -> None:
        super().__init__()
        sizes = [d] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.out = nn.Linear(width, y)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


class SmallCnn(nn.Module):
    """Two convolutions and a Linear head on (1, 12, 12) images."""

    def __init__(self, channels: int = 8, y: int = 10) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, channels, 3), nn.Conv2d(channels, channels, 3)
        self.head = nn.Linear(channels * 8 * 8, y)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


class TiedHead(nn.Module):
    """The output projection reuses the input embedding's weight: structured cannot run."""

    def __init__(self, d: int = 32, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(d, width)
        self.mid = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.mid(torch.tanh(self.inp(x)))) @ self.inp.weight


Case = tuple[str, Callable[[], nn.Module], tuple[int, ...], int, int]
GRID: list[Case] = [  # name, model, per-sample input shape, B1, B2
    ("problem 1 MLP(784,20,10)", lambda: MLP(784, 20, 10), (784,), 256, 256),
    ("problem 1, B1=16, B2=256", lambda: MLP(784, 20, 10), (784,), 16, 256),
    ("wide P MLP(784,128,10)", lambda: MLP(784, 128, 10), (784,), 32, 32),
    ("wide Y MLP(32,32,128)", lambda: MLP(32, 32, 128), (32,), 32, 32),
    ("wide Y MLP(64,64,32)", lambda: MLP(64, 64, 32), (64,), 64, 64),
    ("Y=1 MLP(16,64,1)", lambda: MLP(16, 64, 1), (16,), 256, 256),
    ("Y=1 wide MLP(256,512,1)", lambda: MLP(256, 512, 1), (256,), 128, 128),
    ("small MLP(4,16,2)", lambda: MLP(4, 16, 2), (4,), 16, 16),
    ("deep 6x48 tanh, Y=4", Deep, (8,), 128, 128),
    ("CNN 2 conv, Y=10", SmallCnn, (1, 12, 12), 32, 32),
    ("CNN 2 conv, Y=1", lambda: SmallCnn(8, 1), (1, 12, 12), 64, 64),
    ("CNN 16 channels, Y=10, B=8", lambda: SmallCnn(16, 10), (1, 12, 12), 8, 8),
    ("tied head (no structured)", TiedHead, (32,), 64, 64),
]


def measure(repeat: int = 3) -> list[dict]:
    """Time every runnable method on every grid case; also the sizes the cost model reads."""
    rows = []
    for name, build, shape, b1, b2 in GRID:
        torch.manual_seed(0)
        model = build()
        x1, x2 = torch.randn(b1, *shape), torch.randn(b2, *shape)
        plan = jm.ntk_plan(model, x1, x2)
        times = {m: median_ms(functools.partial(jm.ntk, model, x1, x2, method=m), budget_s=0.0, min_repeats=repeat)
                 for m in plan.costs}
        with torch.no_grad():
            n_out = model(x1[:1]).numel()
        sizes = _sizes(model, x1, x2, n_out)
        rows.append({"name": name, "times": times, "sizes": sizes, "auto": plan.method})
        print(f"{name:32s} " + "  ".join(f"{m} {t:9.2f} ms" for m, t in times.items()), flush=True)
    return rows


def _sizes(model: nn.Module, x1: Tensor, x2: Tensor, n_out: int) -> model_ntk.Sizes:
    from jacmode._probes import layerio
    from jacmode._planning.footprint import measure as footprint

    fp = footprint(model, x1[:1], 1)
    named = list(model.named_parameters())
    cov = layerio.usable(model, x1, named)
    pair = None if cov is None else model_ntk.pair_work(cov, n_out)
    return model_ntk.Sizes(x1.shape[0], x2.shape[0], n_out, sum(p.numel() for _, p in named),
                           fp.flops + fp.conv_flops, pair)


def fit(rows: list[dict]) -> dict[str, tuple[float, ...]]:
    """Non-negative constants per method, fitted on the log of predicted over measured time (as the
    Jacobian engines' are: ``calibrate.nnls_log``)."""
    constants = {}
    for method in model_ntk.METHODS:
        data = [(model_ntk.features(method, r["sizes"]), r["times"][method] / 1e3) for r in rows if method in r["times"]]
        a = np.array([feats for feats, _ in data], dtype=float)
        coef = nnls_log(a, np.array([t for _, t in data]))
        constants[method] = tuple(float(c) for c in coef)
    return constants


def regret(rows: list[dict]) -> list[tuple[str, str, str, float]]:
    """(case, auto's choice under the current constants, fastest, auto time / fastest time)."""
    out = []
    for r in rows:
        costs = {m: model_ntk.estimate(m, r["sizes"]) for m in r["times"]}
        choice = min(costs, key=lambda m: costs[m])
        best = min(r["times"], key=lambda m: r["times"][m])
        out.append((r["name"], choice, best, r["times"][choice] / r["times"][best]))
    return out


def _write(constants: dict[str, tuple[float, ...]], path: Optional[str] = None) -> str:
    """Store the NTK constants (3 significant digits) in ``jacmode/_planning/calibrated.json``."""
    from bench.calibrate import write_data

    return write_data({"NTK_COST": {m: [float(f"{v:.3g}") for v in c] for m, c in constants.items()}}, path)


def _table(rows: list[dict], path: str) -> None:
    lines = ["| shape | B1 x B2 | contraction | products | structured | auto picks | regret |",
             "|---|---|---|---|---|---|---|"]
    for r, (_, choice, _, ratio) in zip(rows, regret(rows)):
        s, t = r["sizes"], r["times"]
        cells = [f"{t[m]:.1f}" if m in t else "-" for m in model_ntk.METHODS]
        lines.append(f"| {r['name']} | {s.b1} x {s.b2} | " + " | ".join(cells) + f" | {choice} | {ratio:.2f} |")
    Path(path).write_text("\n".join(lines) + "\n")


def plot_crossover(path: str) -> None:
    """Time of each method against Y for MLP(64, 64, Y) and SmallCnn(8, Y), B1 = B2 = 32; auto's pick marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ys = [1, 2, 4, 8, 16, 32]
    cases = [("MLP(64, 64, Y)", lambda y: MLP(64, 64, y), (64,)), ("SmallCnn(8, Y)", lambda y: SmallCnn(8, y), (1, 12, 12))]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (title, build, shape) in zip(axes, cases):
        measured: dict[str, list[float]] = {m: [] for m in model_ntk.METHODS}
        picks = []
        for y in ys:
            torch.manual_seed(0)
            model, x = build(y), torch.randn(32, *shape)
            for m in model_ntk.METHODS:
                measured[m].append(median_ms(functools.partial(jm.ntk, model, x, method=m), budget_s=0.0, min_repeats=3))
            picks.append(jm.ntk_plan(model, x).method)
        for m, times in measured.items():
            ax.loglog(ys, times, marker="o", label=m)
        ax.loglog(ys, [measured[p][i] for i, p in enumerate(picks)], "kx", markersize=12, label='"auto" picks')
        ax.set_xlabel(f"outputs per sample Y  ({title}, B1 = B2 = 32)")
        ax.set_ylabel("ms per call (1 thread)")
        ax.legend()
    fig.suptitle("jm.ntk: the three methods and the choice of method='auto'")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="store the fitted constants in jacmode/_planning/calibrated.json")
    parser.add_argument("--plot", help="write the crossover plot to this PNG")
    parser.add_argument("--table", help="write the regret table (markdown) to this file")
    parser.add_argument("--save", help="save the timings to this JSON file")
    parser.add_argument("--load", help="refit timings saved with --save instead of timing")
    parser.add_argument("--check", action="store_true", help="regret of the stored constants on fresh timings (no fit)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.load:
        rows = [dict(r, sizes=model_ntk.Sizes(**r["sizes"])) for r in json.loads(Path(args.load).read_text())]
    else:
        rows = measure()
    if args.save:
        Path(args.save).write_text(json.dumps([dict(r, sizes=dataclasses.asdict(r["sizes"])) for r in rows]))
    constants = fit(rows)
    if not args.check:
        print("fitted:", constants)
        model_ntk.NTK_COST.update(constants)
    for name, choice, best, ratio in regret(rows):
        print(f"{name:32s} auto={choice:12s} fastest={best:12s} regret {ratio:.2f}")
    if args.write and not args.check:
        print("wrote", _write(constants))
    if args.table:
        _table(rows, args.table)
    if args.plot:
        plot_crossover(args.plot)


if __name__ == "__main__":
    main()
