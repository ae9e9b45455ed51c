"""Train a physics-informed network on the damped harmonic oscillator with jacmode.

    u''(t) + 2 zeta omega u'(t) + omega^2 u(t) = 0,   u(0) = 1,  u'(0) = 0,   t in [0, 1]

The exact (underdamped) solution is u(t) = exp(-zeta omega t) (cos(w t) + zeta omega / w sin(w t))
with w = omega sqrt(1 - zeta^2). The network never sees it: it is trained on the equation alone,
with u' and u'' from one ``jacmode.partials(..., create_graph=True)`` call, and only compared with
the exact solution at the end.

Run (5000 Adam steps, about 15 s on one CPU core; relative L2 error 2.3e-3 with the default
seed; matplotlib, for the plot, is in the ``plot`` extra)::

    PYTHONPATH=src python examples/pinn_oscillator.py [--steps 5000] [--out pinn_oscillator.png]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import Tensor, nn

import jacmode as jm

ZETA, OMEGA = 0.2, 6.0


def exact(t: Tensor) -> Tensor:
    w = OMEGA * math.sqrt(1 - ZETA**2)
    return torch.exp(-ZETA * OMEGA * t) * (torch.cos(w * t) + ZETA * OMEGA / w * torch.sin(w * t))


class Network(nn.Module):
    """A tanh network as PINN code writes it; jacmode captures its graph and takes Taylor mode."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.hidden = nn.ModuleList([nn.Linear(1, width), nn.Linear(width, width), nn.Linear(width, width)])
        self.out = nn.Linear(width, 1)

    def forward(self, t: Tensor) -> Tensor:
        for layer in self.hidden:
            t = torch.tanh(layer(t))
        return self.out(t)


def network(width: int = 32) -> nn.Module:
    return Network(width)


def losses(net: nn.Module, t: Tensor, t0: Tensor) -> tuple[Tensor, Tensor]:
    """Mean squared residual of the equation (scaled by 1 / omega^2) and of the initial conditions."""
    u = net(t)
    du, d2u = jm.partials(net, t, [(0,), (0, 0)], create_graph=True)  # u' and u'' from one pass
    residual = d2u / OMEGA**2 + 2 * ZETA * du / OMEGA + u
    u0, du0 = net(t0), jm.derivative(net, t0, 1, create_graph=True)
    return residual.square().mean(), (u0 - 1).square().mean() + (du0 / OMEGA).square().mean()


def train(steps: int, seed: int = 0, lr: float = 1e-2) -> tuple[nn.Module, float]:
    torch.manual_seed(seed)
    net = network()
    t = torch.linspace(0, 1, 256).unsqueeze(1)  # collocation points
    t0 = torch.zeros(1, 1)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=1e-4)
    start = time.perf_counter()
    for step in range(steps):
        pde, ic = losses(net, t, t0)
        loss = pde + 10 * ic
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 500 == 0 or step == steps - 1:
            print(f"step {step:5d}  residual {pde.item():.2e}  initial {ic.item():.2e}")
    return net, time.perf_counter() - start


def relative_l2(net: nn.Module) -> float:
    t = torch.linspace(0, 1, 1001).unsqueeze(1)
    with torch.no_grad():
        return ((net(t) - exact(t)).norm() / exact(t).norm()).item()


def plot(net: nn.Module, path: str, error: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plot was written; "
              "install it with `pip install 'jacmode[plot]'` (or `pip install matplotlib`).")
        return
    t = torch.linspace(0, 1, 501).unsqueeze(1)
    with torch.no_grad():
        pred = net(t)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(t, exact(t), "k-", lw=2, label="exact")
    ax.plot(t, pred, "r--", lw=2, label=f"PINN (relative L2 error {error:.1e})")
    ax.set_xlabel("t")
    ax.set_ylabel("u(t)")
    ax.set_title(rf"$u'' + 2\zeta\omega u' + \omega^2 u = 0$, $\zeta$ = {ZETA}, $\omega$ = {OMEGA}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; one is fastest for batches this small")
    parser.add_argument("--out", default="pinn_oscillator.png", help="PNG file for the plot")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    net, seconds = train(args.steps, args.seed, args.lr)
    error = relative_l2(net)
    print(f"trained {args.steps} steps in {seconds:.1f} s; relative L2 error vs exact: {error:.2e}")
    plot(net, args.out, error)


if __name__ == "__main__":
    main()
