"""``python -m jacmode demo``: the two problems jacmode was founded on, checked and timed.

Problem 2 (dy/dt of a 1 -> 4 tanh network over many time steps) and problem 1 (the (B, Y, P)
parameter Jacobian of the MNIST-shaped MLP), each against the users' own loop and the replies they
got (see shared/problems.md). Prints one table per problem: method, median time, speed-up over the
users' loop, and what jacmode chose and why.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vmap

import jacmode as jm

from ._timing import median_ms


def dydt_net() -> nn.Module:
    """Linear(1, 20) -> tanh -> Linear(20, 20) -> tanh -> Linear(20, 4)."""
    return nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 4))


def mnist_mlp() -> nn.Module:
    """Linear(784, 20) -> ReLU -> Linear(20, 10), P = 15,910."""
    return nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))


def dydt_loop(net: nn.Module, t: Tensor) -> Tensor:
    """The users' loop: one backward pass per time step and output."""
    out = torch.zeros(t.shape[0], 4)
    for i in range(t.shape[0]):
        ti = t[i].clone().requires_grad_(True)
        yi = net(ti)
        for j in range(4):
            out[i, j] = torch.autograd.grad(yi[j], ti, retain_graph=True)[0][0]
    return out


def dydt_full_diagonal(net: nn.Module, t: Tensor) -> Tensor:
    """The reply: the full (B, 4, B, 1) Jacobian (vectorised), then its diagonal."""
    full = torch.autograd.functional.jacobian(net, t, vectorize=True)
    return torch.einsum("bibj->bij", full)[..., 0]


def params_loop(net: nn.Module, x: Tensor) -> Tensor:
    """The users' loop: one forward and one backward pass per sample and output."""
    params = list(net.parameters())
    grads = torch.zeros(x.shape[0], 10, sum(p.numel() for p in params))
    for i in range(x.shape[0]):
        for j in range(10):
            out = net(x[i])
            g = torch.autograd.grad(out[j], params)
            grads[i, j] = torch.cat([t.flatten() for t in g])
    return grads


def params_vmap_jacrev(net: nn.Module, x: Tensor) -> Tensor:
    """The reply: vmap over samples of jacrev of functional_call, then flatten and concatenate."""
    params = {k: v.detach() for k, v in net.named_parameters()}
    jac = vmap(jacrev(lambda p, xi: functional_call(net, p, (xi,))), in_dims=(None, 0))(params, x)
    return torch.cat([j.flatten(2) for j in jac.values()], dim=2)


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
    net = dydt_net()
    print("Problem 2: dy_i/dt at every time step, net 1 -> 20 -> 20 -> 4 (tanh)")
    t = torch.linspace(0, 10, 1000).unsqueeze(1)
    _check("the users' loop (B=1000)", jm.derivative(net, t), dydt_loop(net, t))
    print("  " + repr(jm.plan(net, t)).replace("\n", "\n  "))
    loop = _once_ms(lambda: dydt_loop(net, t))
    full = _once_ms(lambda: dydt_full_diagonal(net, t))
    ones = torch.ones_like(t)
    rows = [
        ("users' loop (B*4 backward passes)", loop),
        ("full Jacobian (vectorize=True), then diagonal", full),
        ("torch.func.jvp with ones (by hand)", median_ms(lambda: jvp(net, (t,), (ones,)))),
        ("jacmode.derivative", median_ms(lambda: jm.derivative(net, t))),
    ]
    _table("  B = 1,000", rows, loop)

    t = torch.rand(100_000, 1) * 10
    with torch.no_grad():
        fwd = median_ms(lambda: net(t))
    ones = torch.ones_like(t)

    def first_call() -> Tensor:
        jm.clear_cache()  # include the coupling probe, as a first call runs it
        return jm.derivative(net, t)

    rows = [
        ("one forward pass, no grad (the floor)", fwd),
        ("torch.func.jvp with ones (by hand)", median_ms(lambda: jvp(net, (t,), (ones,)))),
        ("jacmode.derivative (first call, probe incl.)", median_ms(first_call)),
        ("jacmode.jacobian (auto mode)", median_ms(lambda: jm.jacobian(net, t))),
    ]
    print(f"\n  B = 100,000 (times relative to one no-grad forward pass)")
    print(f"  {'method':<44} {'median':>13} {'x forward':>10}")
    for name, ms in rows:
        print(f"  {name:<44} {ms:10.3f} ms {ms / fwd:9.2f}x")


def demo_params() -> None:
    torch.manual_seed(0)
    net = mnist_mlp()
    print("\nProblem 1: per-sample parameter Jacobian (B, 10, 15910) of Linear(784,20)-ReLU-Linear(20,10)")
    x = torch.randn(2, 784)
    _check("the users' loop (B=2)", jm.jacobian(net, x, wrt="params"), params_loop(net, x))
    print("  " + repr(jm.plan(net, x, wrt="params")).replace("\n", "\n  "))
    loop = median_ms(lambda: params_loop(net, x))
    rows = [
        ("users' loop (B*10 backward passes)", loop),
        ("vmap(jacrev) over functional_call (by hand)", median_ms(lambda: params_vmap_jacrev(net, x))),
        ("jacmode.jacobian(wrt='params')", median_ms(lambda: jm.jacobian(net, x, wrt="params"))),
    ]
    _table("  B = 2", rows, loop)

    x = torch.randn(512, 784)
    _check("vmap(jacrev) (B=512)", jm.jacobian(net, x, wrt="params"), params_vmap_jacrev(net, x))
    buf = torch.empty(512, 10, 15910)
    loop = _once_ms(lambda: params_loop(net, x))
    rows = [
        ("users' loop (B*10 backward passes, one run)", loop),
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
