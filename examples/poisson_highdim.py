"""A PINN for the Poisson equation in D = 100 dimensions, exact against randomised Laplacians.

-Laplace(u) = f in the unit ball of R^100, u = 0 on its sphere, with the exact solution
u*(x) = (1 - |x|^2) g(x), g(x) = mean_j sin(a_j . x) for 16 fixed random vectors a_j (so f has a
closed form, below). The network enforces the boundary condition by construction,
u(x) = (1 - |x|^2) N(x) with N a tanh MLP 100-128-128-1, and is trained on the residual alone:
once with the exact Laplacian (``jm.laplacian``, 100 directions per step) and once with the
Hutchinson estimate from K = 16 Rademacher directions per sample (``samples=16``). Both are scored
by the relative L2 error against u* on 2,000 held-out points.

    PYTHONPATH=src python examples/poisson_highdim.py [--steps 1500] [--out docs/img/poisson100.png]

Needs matplotlib for the plot (``pip install matplotlib``); without it the script still trains and
prints the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import Tensor, nn

import jacmode as jm

D, J, WIDTH = 100, 16, 128


class Ansatz(nn.Module):
    """u(x) = (1 - |x|^2) N(x): zero on the unit sphere."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(D, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return (1 - (x * x).sum(1, keepdim=True)) * self.out(h)


def exact(x: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """u*(x) and f = -Laplace(u*), from Laplace(phi g) = g Laplace(phi) + 2 grad(phi).grad(g) + phi Laplace(g)."""
    s = x @ a.t()  # (B, J)
    phi = 1 - (x * x).sum(1, keepdim=True)
    g = torch.sin(s).mean(1, keepdim=True)
    x_grad_g = (torch.cos(s) * s).mean(1, keepdim=True)  # x . grad g
    lap_g = -(torch.sin(s) * (a * a).sum(1)).mean(1, keepdim=True)
    return phi * g, -(-2 * D * g - 4 * x_grad_g + phi * lap_g)


def ball(n: int, gen: torch.Generator) -> Tensor:
    """n points uniform in the unit ball of R^D."""
    d = torch.randn(n, D, generator=gen)
    r = torch.rand(n, 1, generator=gen) ** (1 / D)
    return d / d.norm(dim=1, keepdim=True) * r


def train(method: str, steps: int, batch: int, seed: int, a: Tensor, test: Tensor, u_test: Tensor) -> dict:
    torch.manual_seed(seed)
    net = Ansatz()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen, draws = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
    curve, times = [], []
    for step in range(steps + 1):
        if step % 50 == 0 or step == steps:
            with torch.no_grad():
                err = ((net(test) - u_test).norm() / u_test.norm()).item()
            curve.append((step, sum(times), err))
        if step == steps:
            break
        x = ball(batch, gen)
        _, f = exact(x, a)
        start = time.process_time()  # CPU time of this process: steady on a shared machine
        if method == "exact":
            lap = jm.laplacian(net, x, create_graph=True)
        else:
            lap = jm.laplacian(net, x, samples=16, generator=draws, create_graph=True)
        loss = (lap + f).square().mean() / f.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        times.append(time.process_time() - start)
    per_step = sorted(times)[len(times) // 2]
    return {"method": method, "curve": curve, "ms_per_step": 1000 * per_step, "total_s": sum(times),
            "final_error": curve[-1][2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="poisson100.png")
    parser.add_argument("--json", default=None, help="also write the curves as JSON")
    parser.add_argument("--replot", default=None, help="plot the curves of an earlier --json run instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.replot:
        with open(args.replot) as fh:
            runs = json.load(fh)
    else:
        gen = torch.Generator().manual_seed(1234)
        a = torch.randn(J, D, generator=gen) / math.sqrt(D) * 2
        test = ball(2000, gen)
        u_test, _ = exact(test, a)
        runs = [train(m, args.steps, args.batch, args.seed, a, test, u_test) for m in ("exact", "randomised")]
    for r in runs:
        print(f"{r['method']:>10}: relative L2 error {r['final_error']:.2e}, {r['ms_per_step']:.1f} ms per step "
              f"(median CPU time), {r['total_s']:.0f} s of training")
    if args.json and not args.replot:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib for the plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r, label in zip(runs, ("exact Laplacian (100 directions)", "randomised, K = 16 Rademacher")):
        steps, secs, errs = zip(*r["curve"])
        left.semilogy(steps, errs, label=label)
        right.semilogy(secs, errs, label=f"{label}: {r['ms_per_step']:.0f} ms/step")
    left.set_xlabel("Adam step")
    right.set_xlabel("training time (CPU s, one thread)")
    for ax in (left, right):
        ax.set_ylabel("relative L2 error")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Poisson equation in the unit ball of R^100")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
