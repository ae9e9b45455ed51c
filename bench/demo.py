"""``python -m bench.demo`` (``make demo``): the two problems jacmode was founded on, checked and timed.

Problem 2 (dy/dt of a 1 -> 4 tanh network over many time steps) and problem 1 (the (B, Y, P)
parameter Jacobian of the MNIST-shaped MLP), each against the users' own loop and the replies they
got (see shared/problems.md). Prints one table per problem: method, median time, speed-up over the
users' loop, and what jacmode chose and why.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, cast

import torch
from torch import Tensor
from torch.func import jvp

import jacmode as jm

from .baselines import (
    dydt_full_diagonal,
    dydt_loop,
    mnist_mlp,
    params_loop,
    params_vmap_jacrev,
    time_mlp,
)
from .timing import median_ms


def _row(name: str, ms: float, base: Optional[float]) -> str:
    speed = f"{base / ms:9.1f}x" if base else "          "
    return f"  {name:<44} {ms:10.3f} ms {speed}"


def _table(title: str, rows: list[tuple[str, float]], base: Optional[float]) -> None:
    print(f"\n{title}")
    print(f"  {'method':<44} {'median':>13} {'speed-up':>10}")
    for name, ms in rows:
        print(_row(name, ms, base))


def _check(name: str, got: Tensor, want: Tensor) -> None:
    err = (got - want).abs().max().item()
    ok = torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    print(f"  check {name}: max |jacmode - reference| = {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    if not ok:
        raise SystemExit(f"demo: jacmode disagrees with {name}")


def _once_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def demo_dydt() -> None:
    torch.manual_seed(0)
    net = time_mlp()
    print("Problem 2: dy_i/dt at every time step, the class net_x of problems.md (1 -> 20 -> 20 -> 4, torch.tanh in forward)")
    t = torch.linspace(0, 10, 1000).unsqueeze(1)
    _check("the users' loop (B=1000)", jm.derivative(net, t), dydt_loop(net, t))
    print("  " + repr(jm.plan(net, t)).replace("\n", "\n  "))
    loop = _once_ms(lambda: dydt_loop(net, t))
    full = _once_ms(lambda: dydt_full_diagonal(net, t))
    ones = torch.ones_like(t)
    rows = [
        ("users' loop (B*4 forward+backward passes)", loop),
        ("full Jacobian, then diagonal", full),
        ("torch.func.jvp with ones (by hand)", median_ms(lambda: jvp(net, (t,), (ones,)))),
        ("jacmode.derivative", median_ms(lambda: jm.derivative(net, t))),
    ]
    _table("  B = 1,000", rows, loop)

    t = torch.rand(100_000, 1) * 10
    with torch.no_grad():
        fwd = median_ms(lambda: net(t))
    ones = torch.ones_like(t)

    def first_call() -> Tensor:
        jm.clear_cache()  # every cache cleared: the coupling probe and the planner's probes run
        return cast(Tensor, jm.jacobian(net, t))

    rows = [
        ("one forward pass, no grad (the floor)", fwd),
        ("torch.func.jvp with ones (by hand)", median_ms(lambda: jvp(net, (t,), (ones,)))),
        ("jacmode.jacobian, auto, as a first call", median_ms(first_call)),
        ("jacmode.jacobian, auto (cached plan)", median_ms(lambda: jm.jacobian(net, t))),
        ("jacmode.derivative", median_ms(lambda: jm.derivative(net, t))),
    ]
    print("\n  B = 100,000 (times relative to one no-grad forward pass)")
    print(f"  {'method':<44} {'median':>13} {'x forward':>10}")
    for name, ms in rows:
        print(f"  {name:<44} {ms:10.3f} ms {ms / fwd:9.2f}x")


def demo_params() -> None:
    torch.manual_seed(0)
    net = mnist_mlp()
    print("\nProblem 1: per-sample parameter Jacobian (B, 10, 15910) of the class MLP(784, 20, 10) of problems.md")
    x = torch.randn(2, 784)
    _check("the users' loop (B=2)", cast(Tensor, jm.jacobian(net, x, wrt="params")), params_loop(net, x))
    print("  " + repr(jm.plan(net, x, wrt="params")).replace("\n", "\n  "))
    loop = median_ms(lambda: params_loop(net, x))
    rows = [
        ("users' loop (B*10 forward+backward passes)", loop),
        ("vmap(jacrev) over functional_call (by hand)", median_ms(lambda: params_vmap_jacrev(net, x))),
        ("jacmode.jacobian(wrt='params')", median_ms(lambda: jm.jacobian(net, x, wrt="params"))),
    ]
    _table("  B = 2", rows, loop)

    x = torch.randn(512, 784)
    _check("vmap(jacrev) (B=512)", cast(Tensor, jm.jacobian(net, x, wrt="params")), params_vmap_jacrev(net, x))
    buf = torch.empty(512, 10, 15910)
    loop = _once_ms(lambda: params_loop(net, x))
    rows = [
        ("users' loop (B*10 forward+backward, one run)", loop),
        ("vmap(jacrev) over functional_call (by hand)", median_ms(lambda: params_vmap_jacrev(net, x))),
        ("jacmode.jacobian(wrt='params')", median_ms(lambda: jm.jacobian(net, x, wrt="params"))),
        ("jacmode.jacobian(wrt='params', out=buffer)", median_ms(lambda: jm.jacobian(net, x, wrt="params", out=buf))),
    ]
    _table("  B = 512 (result: 326 MB)", rows, loop)


def main() -> int:
    print(f"jacmode {jm.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    demo_dydt()
    demo_params()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
