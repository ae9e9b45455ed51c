"""Vector products side by side: jm.hvp, jm.jvp, jm.vjp, jm.linearize against torch.func's idioms.

Benchmark tooling, not part of the package. One torch thread; each row times its methods
interleaved (round-robin, so a load spike on a shared machine hits all of them alike) and prints
the median CPU time (``time.process_time``) of each and their ratio.

    PYTHONPATH=src python bench/products_vector.py [--repeats 31]

Rows and their targets:

* ``hvp inputs``: tanh MLP D = 100 -> 1, B = 1024, float64: ``jm.hvp(f, x, v)`` (H_b v_b) against
  forming the per-sample Hessian with jacmode, ``jm.hessian(f, x)`` (B, D, D), and contracting it
  (target <= 0.5x), and torch.func's ``vmap(jvp(grad))``.
* ``hvp params``: problem 1's class MLP(784, 20, 10), P = 15,910, squared-error loss summed over
  the batch: ``jm.hvp(net, x, v, wrt="params", loss=..., y=...)`` against torch.func's
  ``jvp(grad(L), (params,), (v,))`` (target <= 1.5x; the largest difference is printed, float64).
* ``jvp params`` / ``vjp params``: per-sample products on problem 1's class: ``jm.jvp(net, x, v,
  wrt="params")`` (J_b v, (B, 10)) against ``torch.func.jvp`` over ``functional_call``, and
  ``jm.vjp(net, x, wrt="params")`` + ``vjp_fn(u)`` (u_b^T J_b, (B, P)) against the hand-written
  ``vmap`` over samples of ``torch.func.vjp`` (target within 1.2x), whole calls (the fixed cost
  included) at B = 2 and B = 256, and the application ``vjp_fn(u)`` alone.
* ``linearize``: the application cost of ``jm.linearize`` (J v) against ``torch.func.linearize``'s
  ``jvp_fn`` and a fresh ``torch.func.jvp``.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, linearize, vjp, vmap

import jacmode as jm
from bench.baselines import MLP  # problem 1's class


def race(methods: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median CPU seconds of each method, run round-robin after one warm-up call each."""
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(repeats):
        for k, fn in methods.items():
            t = time.process_time()
            fn()
            times[k].append(time.process_time() - t)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


ROWS: list[str] = []  # the markdown table of --out


def show(title: str, med: dict[str, float], base: str, target: str = "") -> None:
    ref = med[base]
    ROWS.append(f"| **{title}** | | {'target: ' + target if target else ''} |")
    ROWS.extend(f"| {k} | {t * 1e3:.3f} ms | {t / ref:.3g}x |" for k, t in med.items())
    print(f"\n{title}")
    for k, t in med.items():
        print(f"  {k:<48s} {t * 1e3:9.3f} ms   {t / ref:6.2f}x {base}")
    if target:
        print(f"  target: {target}")


def hvp_inputs(repeats: int) -> None:
    torch.manual_seed(0)
    d, b = 100, 1024
    net = nn.Sequential(nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    x, v = torch.randn(b, d, dtype=torch.float64), torch.randn(b, d, dtype=torch.float64)

    def f(z: Tensor) -> Tensor:
        return net(z).squeeze(1)

    def one(z: Tensor) -> Tensor:
        return net(z[None])[0, 0]

    per_sample = vmap(lambda z, w: jvp(grad(one), (z,), (w,))[1])
    hv = jm.hvp(f, x, v)
    err = (hv - torch.einsum("bij,bj->bi", jm.hessian(f, x).reshape(b, d, d), v)).abs().max().item()
    err2 = (hv - per_sample(x, v)).abs().max().item()
    full = vmap(torch.func.hessian(one))
    med = race({  # forming (B, D, D) takes seconds: three runs
        "jm.hessian(f, x) + einsum": lambda: torch.einsum("bij,bj->bi", jm.hessian(f, x).reshape(b, d, d), v),
        "torch.func vmap(hessian) + einsum": lambda: torch.einsum("bij,bj->bi", full(x), v),
    }, 3)
    med.update(race({
        "jm.hvp(f, x, v)": lambda: jm.hvp(f, x, v),
        "jm.hvp(f, x, v, mode='forward')": lambda: jm.hvp(f, x, v, mode="forward"),
        "torch.func vmap(jvp(grad))": lambda: per_sample(x, v),
    }, repeats))
    show(f"hvp wrt inputs, tanh MLP D={d}, B={b}, float64 (max abs diff vs Hessian {err:.1e}, vs torch.func {err2:.1e})",
         med, "jm.hessian(f, x) + einsum", "jm.hvp <= 0.5x forming the Hessian and contracting")


def hvp_params(repeats: int, b: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    net = MLP(784, 20, 10).to(dtype)
    x, y = torch.randn(b, 784, dtype=dtype), torch.randn(b, 10, dtype=dtype)
    params = {k: p.detach() for k, p in net.named_parameters()}
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def total(p: dict[str, Tensor]) -> Tensor:
        return ((functional_call(net, p, (x,)) - y) ** 2).sum()

    def per_sample_loss(out: Tensor, yy: Tensor) -> Tensor:
        return ((out - yy) ** 2).sum(1)

    ref = jvp(grad(total), (params,), (v,))[1]
    ours = jm.hvp(net, x, v, wrt="params", loss=per_sample_loss, y=y)
    err = max(((ours[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
    med = race({
        "torch.func jvp(grad(L))": lambda: jvp(grad(total), (params,), (v,))[1],
        "jm.hvp(net, x, v, wrt='params', loss=, y=)": lambda: jm.hvp(net, x, v, wrt="params", loss=per_sample_loss, y=y),
        "jm.hvp(..., mode='forward')": lambda: jm.hvp(net, x, v, wrt="params", loss=per_sample_loss, y=y, mode="forward"),
    }, repeats)
    show(f"hvp wrt params, problem 1's MLP (P=15,910), B={b}, {str(dtype)[6:]} (max relative diff {err:.1e})",
         med, "torch.func jvp(grad(L))", "<= 1.5x torch.func's jvp(grad), equal to float64 precision")


def jvp_vjp_params(repeats: int, b: int) -> None:
    torch.manual_seed(0)
    net = MLP(784, 20, 10)
    x, u = torch.randn(b, 784), torch.randn(b, 10)
    params = {k: p.detach() for k, p in net.named_parameters()}
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def fwd(p: dict[str, Tensor]) -> Tensor:
        return functional_call(net, p, (x,))

    med = race({
        "torch.func.jvp(functional_call)": lambda: jvp(fwd, (params,), (v,)),
        "jm.jvp(net, x, v, wrt='params')": lambda: jm.jvp(net, x, v, wrt="params"),
    }, repeats)
    show(f"jvp wrt params per sample (J_b v, (B, 10)), problem 1's MLP, B={b}, float32, whole call",
         med, "torch.func.jvp(functional_call)", "within 1.2x of the hand-written torch.func call")

    def one(p: dict[str, Tensor], xb: Tensor, ub: Tensor) -> dict[str, Tensor]:
        return vjp(lambda q: functional_call(net, q, (xb[None],)), p)[1](ub[None])[0]

    per_sample = vmap(one, in_dims=(None, 0, 0))
    rows = jm.vjp(net, x, wrt="params")[1](u)
    ref = torch.cat([t.reshape(b, -1) for t in per_sample(params, x, u).values()], 1)
    err = (rows - ref).abs().max().item()
    med = race({
        "torch.func vmap(vjp) per sample": lambda: per_sample(params, x, u),
        "jm.vjp(net, x, wrt='params')[1](u)": lambda: jm.vjp(net, x, wrt="params")[1](u),
        "torch.func.vjp (summed, reference)": lambda: vjp(fwd, params)[1](u),
    }, repeats)
    show(f"vjp wrt params per sample (u_b^T J_b, (B, P)), problem 1's MLP, B={b}, whole call (max abs diff {err:.1e})",
         med, "torch.func vmap(vjp) per sample", "within 1.2x of the hand-written torch.func call")
    _, ours = jm.vjp(net, x, wrt="params")
    med = race({
        "torch.func vmap(vjp) per sample": lambda: per_sample(params, x, u),
        "vjp_fn(u) alone (jm)": lambda: ours(u),
    }, repeats)
    show(f"vjp wrt params per sample, B={b}: the application alone", med, "torch.func vmap(vjp) per sample")


def fixed_cost(repeats: int) -> None:
    """Whole calls on a model with almost no work (Linear(1, 1), B = 1): what each call costs beyond it."""
    torch.manual_seed(0)
    net = MLP(1, 1, 1)
    x, u = torch.randn(1, 1), torch.randn(1, 1)
    params = {k: p.detach() for k, p in net.named_parameters()}
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def fwd(p: dict[str, Tensor]) -> Tensor:
        return functional_call(net, p, (x,))

    def one(p: dict[str, Tensor], xb: Tensor, ub: Tensor) -> dict[str, Tensor]:
        return vjp(lambda q: functional_call(net, q, (xb[None],)), p)[1](ub[None])[0]

    per_sample = vmap(one, in_dims=(None, 0, 0))
    med = race({
        "torch.func.jvp(functional_call)": lambda: jvp(fwd, (params,), (v,)),
        "jm.jvp(net, x, v, wrt='params')": lambda: jm.jvp(net, x, v, wrt="params"),
        "torch.func vmap(vjp) per sample": lambda: per_sample(params, x, u),
        "jm.vjp(net, x, wrt='params')[1](u)": lambda: jm.vjp(net, x, wrt="params")[1](u),
        "torch.func.jvp(net, (x,), (x,)) (inputs)": lambda: jvp(net, (x,), (x,)),
        "jm.jvp(net, x, x) (inputs)": lambda: jm.jvp(net, x, x),
        "torch.func.vjp(net, x)[1](u) (inputs)": lambda: vjp(net, x)[1](u),
        "jm.vjp(net, x)[1](u) (inputs)": lambda: jm.vjp(net, x)[1](u),
    }, repeats)
    show("fixed cost: whole calls on MLP(1, 1, 1), B=1 (the work is negligible)", med,
         "torch.func.jvp(functional_call)")


class Masked(nn.Module):
    """Problem 1's class with a per-sample mask on the hidden layer: model(x, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 20), nn.Linear(20, 10)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * mask)


class Concatenated(nn.Module):
    """The work-around of old: one input z = [x, mask], split in forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, z: Tensor) -> Tensor:
        return self.model(z[:, :784], z[:, 784:])


def several_arguments(repeats: int, b: int) -> None:
    torch.manual_seed(0)
    model = Masked()
    x, mask, y = torch.randn(b, 784), (torch.rand(b, 20) > 0.2).float(), torch.randn(b, 10)
    z, wrapped = torch.cat([x, mask], 1), Concatenated(model)

    def loss(out: Tensor, t: Tensor) -> Tensor:
        return ((out - t) ** 2).sum(1)

    med = race({
        "per_sample_grads(Concatenated, z)": lambda: jm.per_sample_grads(wrapped, z, loss, y=y),
        "per_sample_grads(model, (x, mask))": lambda: jm.per_sample_grads(model, (x, mask), loss, y=y),
    }, repeats)
    show(f"several arguments: per_sample_grads of model(x, mask), B={b}, against one concatenated input", med,
         "per_sample_grads(Concatenated, z)")


def linearize_rows(repeats: int) -> None:
    torch.manual_seed(0)
    d, b = 100, 1024
    net = nn.Sequential(nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, d))
    x, v = torch.randn(b, d), torch.randn(b, d)
    lin = jm.linearize(net, x)
    _, jvp_fn = linearize(net, x)
    err = (lin(v) - jvp_fn(v)).abs().max().item()
    med = race({
        "torch.func.jvp (fresh each time)": lambda: jvp(net, (x,), (v,)),
        "torch.func.linearize jvp_fn(v)": lambda: jvp_fn(v),
        "jm.linearize: lin(v)": lambda: lin(v),
        "jm.linearize: lin.vjp(v)": lambda: lin.vjp(v),
        "jm.jvp(net, x, v)": lambda: jm.jvp(net, x, v),
    }, repeats)
    t0 = time.process_time()
    jm.linearize(net, x)(v)
    t1 = time.process_time()
    linearize(net, x)[1](v)
    t2 = time.process_time()
    show(f"linearize, tanh MLP {d} -> {d}, B={b}, float32: one application (max abs diff {err:.1e}); "
         f"build + first application: jm {1e3 * (t1 - t0):.1f} ms, torch.func {1e3 * (t2 - t1):.1f} ms",
         med, "torch.func.jvp (fresh each time)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--out", default=None, help="also write the rows as a markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, medians of {args.repeats} interleaved runs (CPU time)")
    hvp_inputs(args.repeats)
    hvp_params(args.repeats, 256, torch.float64)
    hvp_params(args.repeats, 2, torch.float32)
    hvp_params(args.repeats, 256, torch.float32)
    for b in (2, 256):
        jvp_vjp_params(args.repeats, b)
    fixed_cost(args.repeats)
    linearize_rows(args.repeats)
    for b in (32, 512):
        several_arguments(args.repeats, b)
    if args.out:
        head = (f"torch {torch.__version__}, 1 thread, medians of {args.repeats} interleaved runs (CPU time); "
                "ratios against the first row of each block.\n\n| method | median | ratio |\n|---|---|---|\n")
        with open(args.out, "w") as fh:
            fh.write(head + "\n".join(ROWS) + "\n")


if __name__ == "__main__":
    main()
