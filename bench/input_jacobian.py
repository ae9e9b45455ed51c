"""Input Jacobians of the problems' classes: jacmode's modes against ``vmap(jacrev)``, side by side.

``python -m bench.input_jacobian [threads]`` prints, per class and batch size, the medians (ms) of
torch.func's per-sample idiom ``vmap(jacrev(lambda xb: net(xb[None])[0]))(x)``, ``jm.jacobian`` with
mode auto / forward / reverse, and the mode and strategy the planner picks. The auto column should
never be slower than the better explicit mode, nor than ``vmap(jacrev)``.
"""
# mypy: ignore-errors

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.func import jacrev, vmap

import jacmode as jm
from bench.baselines import MLP, NetX, PinnNet
from bench.timing import median_ms


def med(fn):
    return median_ms(fn, budget_s=3.0, min_repeats=3, max_repeats=15, warmup=2)


def cases():
    torch.manual_seed(0)
    mlp = MLP(784, 20, 10)
    for B in (2, 64, 1024):
        yield "MLP(784,20,10)", mlp, torch.randn(B, 784)
    tanh_first = nn.Sequential(nn.Tanh(), nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))
    for B in (2, 64):
        yield "Tanh,MLP(784,20,10)", tanh_first, torch.randn(B, 784)
    yield "NetX", NetX(), torch.linspace(0, 10, 10_000).unsqueeze(1)
    yield "PinnNet(2,64,2)", PinnNet(2, 64, 2), torch.rand(10_000, 2)
    yield "PinnNet(10,64,2,d_out=3)", PinnNet(10, 64, 2, 3), torch.rand(4096, 10)


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print(f"{'class':26} {'B':>6} {'vmap(jacrev)':>12} {'auto':>8} {'forward':>8} {'reverse':>8}  plan")
    for label, net, x in cases():
        ref = lambda: vmap(jacrev(lambda xb: net(xb[None])[0]))(x)  # noqa: E731
        t = [med(ref)] + [med(lambda m=m: jm.jacobian(net, x, mode=m)) for m in ("auto", "forward", "reverse")]
        plan = jm.plan(net, x)
        print(f"{label:26} {x.shape[0]:>6} " + " ".join(f"{v:>{w}.3g}" for v, w in zip(t, (12, 8, 8, 8)))
              + f"  {plan.mode}/{plan.strategy} (est. " + ", ".join(f"{m}={c * 1e3:.3g}" for m, c in plan.costs.items())
              + " ms)")


if __name__ == "__main__":
    main()
