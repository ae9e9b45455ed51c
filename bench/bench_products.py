"""The targets of per_sample_grads, ntk and ggn on problem 1's class, side by side in one process.

``python -m bench.bench_products [--rounds N] [--markdown PATH] [--memory]`` times, with one
thread, every method of each target in interleaved rounds (medians), prints the ratios its targets
are set on, and with ``--memory`` the peak resident memory above the set-up of each method, each in a
fresh process. The asv suite ``bench_products.py`` times the same callables.

Example:
    >>> from bench.bench_products import METHODS, problem
    >>> model, x, y = problem(4)
    >>> METHODS["per_sample_grads"]["jacmode"](model, x, y).shape
    torch.Size([4, 15910])
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap

import jacmode as jm
from bench import ROOT
from bench.baselines import MLP
from bench.bench import _maxrss_growth, _rss_peak

Method = Callable[[nn.Module, Tensor, Tensor], Tensor]
SIZES = {"per_sample_grads": 512, "ntk": 256, "ggn_diagonal": 1000}


def problem(batch: int, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """Problem 1's class MLP(784, 20, 10), a batch of inputs and class labels."""
    torch.manual_seed(seed)
    return MLP(784, 20, 10), torch.randn(batch, 784), torch.randint(0, 10, (batch,))


def _ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def psg(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """jm.per_sample_grads with the per-sample cross-entropy."""
    g = jm.per_sample_grads(model, x, _ce, y=y)
    assert isinstance(g, Tensor)
    return g


def vmap_grad(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per-sample gradients as torch.func's tutorial writes them: vmap(grad) over functional_call."""
    def one(p: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xb[None],)), yb[None])

    g = vmap(grad(one), in_dims=(None, 0, 0))(_params(model), x, y)
    return torch.cat([v.reshape(x.shape[0], -1) for v in g.values()], 1)


def allocate_fill(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The floor of any (B, P) result: allocate it and write every entry once."""
    n = sum(p.numel() for p in model.parameters())
    return torch.empty(x.shape[0], n).fill_(1.0)


def ntk_tutorial(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The PyTorch NTK tutorial's method: two vmap(jacrev) Jacobians, contracted (here x2 = x1)."""
    j = vmap(jacrev(lambda p, xb: functional_call(model, p, (xb[None],))[0]), (None, 0))(_params(model), x)
    flat = torch.cat([v.reshape(x.shape[0], v.shape[1], -1) for v in j.values()], 2)
    return torch.einsum("byp,czp->bcyz", flat, flat)


METHODS: dict[str, dict[str, Method]] = {
    "per_sample_grads": {
        "jacmode": psg,
        "vmap(grad) over functional_call": vmap_grad,
        "allocate + fill (B, P)": allocate_fill,
    },
    "ntk": {
        "jacmode (auto)": lambda m, x, y: jm.ntk(m, x),
        "two vmap(jacrev), contracted": ntk_tutorial,
    },
    "ggn_diagonal": {
        "jacmode ggn(diagonal=True)": lambda m, x, y: jm.ggn(m, x, "cross_entropy", diagonal=True),
        "jacmode per_sample_grads": psg,
    },
}


def time_target(target: str, rounds: int) -> dict[str, float]:
    """Median ms of every method of ``target``, in interleaved rounds (one call each per round)."""
    model, x, y = problem(SIZES[target])
    fns = METHODS[target]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(model, x, y)
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(model, x, y)
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def peak_bytes(target: str, method: str) -> int:
    """Peak resident memory of one call above the set-up (after a warm-up call on 2 samples).

    Measured as the bench command does (``bench/bench.py``): VmHWM after resetting it, or the growth
    of ru_maxrss where /proc is missing.
    """
    model, x, y = problem(SIZES[target])
    METHODS[target][method](model, x[:2], y[:2])
    try:
        growth = _rss_peak()
    except OSError:
        growth = _maxrss_growth()
    METHODS[target][method](model, x, y)
    return growth()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--markdown", help="write the table to this file")
    parser.add_argument("--memory", action="store_true", help="peak memory per method, fresh processes")
    parser.add_argument("--peak", nargs=2, metavar=("TARGET", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.peak:
        print(peak_bytes(*args.peak))
        return
    lines = ["| target | B | method | ms | ratio to jacmode |" + (" peak MiB |" if args.memory else ""),
             "|---|---|---|---|---|" + ("---|" if args.memory else "")]
    for target in METHODS:
        times = time_target(target, args.rounds)
        ours = next(t for name, t in times.items() if name.startswith("jacmode"))
        for name, t in times.items():
            row = f"| {target} | {SIZES[target]} | {name} | {t:.2f} | {t / ours:.2f} |"
            if args.memory:
                out = subprocess.run([sys.executable, "-m", "bench.bench_products", "--peak", target, name],
                                     capture_output=True, text=True, check=True, cwd=ROOT).stdout
                row += f" {int(out) / 2**20:.1f} |"
            lines.append(row)
            print(row, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
