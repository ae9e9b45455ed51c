"""The PINN training step written ``u(x, t)`` against the same residual with one concatenated input.

Benchmark tooling, not part of the package (target: the ``u(x, t)`` step <= 1.05x the
concatenated one). Heat equation u_t = nu u_xx, B = 10,000 collocation points, a tanh MLP
2 -> 64 -> 64 -> 1, float32, one torch thread. One step: u_t and u_xx from one ``partials`` call
with ``create_graph=True``, the residual's mean square, ``backward``. Both forms run interleaved
(the order rotated every round), timed as the process's CPU time, and the medians are printed side
by side with their ratio.

    PYTHONPATH=src python bench/callforms.py [--batch 10000] [--repeats 41]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from torch import Tensor, nn

import jacmode as jm

NU = 0.1


def build(batch: int) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    return net, torch.rand(batch, 1), torch.rand(batch, 1)


def steps(net: nn.Module, x: Tensor, t: Tensor) -> dict[str, Callable[[], None]]:
    def u(x: Tensor, t: Tensor) -> Tensor:
        return net(torch.cat([x, t], 1))

    xt = torch.cat([x, t], 1)

    def concatenated() -> None:
        u_x_t, u_xx = jm.partials(net, xt, [(1,), (0, 0)], create_graph=True)
        ((u_x_t - NU * u_xx) ** 2).mean().backward()

    def named() -> None:
        u_t, u_xx = jm.partials(u, x, t, dims=[("t",), ("x", "x")], create_graph=True)
        ((u_t - NU * u_xx) ** 2).mean().backward()

    def rider() -> None:  # u_xx only needs x differentiated: t is a batched rider, u_t from argnums=1
        u_xx, = jm.partials(u, x, t, dims=[(0, 0)], argnums=0, create_graph=True)
        u_t, = jm.partials(u, x, t, dims=[(0,)], argnums=1, create_graph=True)
        ((u_t - NU * u_xx) ** 2).mean().backward()

    return {"concatenated (B, 2)": concatenated, "u(x, t), dims named": named,
            "u(x, t), two calls (t a rider, then x)": rider}


def one_ms(fn: Callable[[], None], net: nn.Module) -> float:
    """CPU time of the process over one step (steadier than wall time on a shared machine)."""
    net.zero_grad(set_to_none=True)
    t0 = time.process_time()
    fn()
    return 1e3 * (time.process_time() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    torch.set_num_threads(1)
    net, x, t = build(args.batch)
    cases = steps(net, x, t)
    for fn in cases.values():  # first calls: capture, checks, probes
        for _ in range(3):
            one_ms(fn, net)
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.repeats):  # interleaved, the order rotated every round
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(one_ms(cases[name], net))
    base = statistics.median(times["concatenated (B, 2)"])
    print(f"PINN heat step, B = {args.batch}, tanh MLP 2-64-64-1, float32, 1 thread, medians of {args.repeats}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:42s} {m:8.2f} ms   {m / base:5.3f}x")


if __name__ == "__main__":
    main()
