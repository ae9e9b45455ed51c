"""Differential operators side by side: jacmode, jet-for-pytorch's collapsed Taylor mode, nested autograd.

Benchmark tooling, not part of the package. jet-for-pytorch 1.0 (the code of "Collapsing Taylor
Mode Automatic Differentiation", NeurIPS 2025) is a benchmark-only dependency: in a separate
environment with torch 2.13 CPU, ``pip install --no-deps --ignore-requires-python jet-for-pytorch``
(plus scipy), with the ``type PyTree[...] = ...`` alias of ``jet/utils.py`` replaced by a plain
class (Python 3.11). jet's and nested autograd's functions are jet's own benchmark code
(``jet.exp.exp01_benchmark_laplacian.execute``, rewritten here without its jax import):
``jet_simplified`` = collapsed with common subexpression elimination, vmapped over samples, and
``hessian_trace`` = vmap over samples of the forward-over-reverse Hessian's trace.

    PYTHONPATH=src /tmp/jetenv/bin/python bench/operators.py [--out docs/data/operators.md]

Every (workload, method) runs in a fresh subprocess, one torch thread, float32: the peak memory is
the growth of the resident set's high-water mark (``ru_maxrss``) over one call after a warm-up on
4 samples (so tracing and first-call costs are outside it), the time the median CPU time of the
process (``time.process_time``) over several calls, steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from torch import Tensor, nn

CASES: dict[str, dict[str, Any]] = {
    "laplacian": dict(op="lap", layers=[768, 768, 512, 512], D=50, B=256, methods=["nested", "jet", "jacmode"]),
    "laplacian, create_graph": dict(op="lap", layers=[768, 768, 512, 512], D=50, B=256, graph=True,
                                    methods=["nested", "jet", "jacmode"]),
    "weighted Laplacian": dict(op="wlap", layers=[768, 768, 512, 512], D=50, B=256,
                               methods=["nested", "jet", "jacmode"]),
    "biharmonic": dict(op="bih", layers=[768, 768, 512, 512], D=5, B=64, methods=["nested", "jet", "jacmode"]),
    "laplacian, PINN class": dict(op="lap", layers=[64, 64], D=10, B=4096, cls=True, methods=["nested", "jet", "jacmode"]),
    **{f"depth {k}": dict(op="lap", layers=[768] * k, D=50, B=256, methods=["jet", "jacmode"]) for k in (1, 2, 4, 6)},
    "randomised laplacian": dict(op="rlap", layers=[128, 128], D=1000, B=256, K=16,
                                 methods=["forward", "jacmode exact", "jet", "jacmode"]),
}


class PinnNet(nn.Module):
    """The PINN class as written in PINN code: functional tanh in forward."""

    def __init__(self, d: int, widths: list[int]) -> None:
        super().__init__()
        sizes = [d, *widths]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.out = nn.Linear(sizes[-1], 1)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def _model(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    if case.get("cls"):
        return PinnNet(case["D"], case["layers"])
    sizes, mods = [case["D"], *case["layers"]], []
    for a, b in zip(sizes, sizes[1:]):
        mods += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(sizes[-1], 1))


def _setup(case: dict[str, Any], method: str, net: nn.Module, x: Tensor) -> Callable[[], Tensor]:
    op, graph = case["op"], case.get("graph", False)
    D = case["D"]
    if method == "jacmode" or method == "jacmode exact":
        import jacmode as jm

        if op == "lap" or method == "jacmode exact":
            return lambda: jm.laplacian(net, x, create_graph=graph)
        if op == "wlap":
            S = torch.diag((torch.arange(D, dtype=x.dtype) + 1).sqrt())
            return lambda: jm.laplacian(net, x, weight=S, create_graph=graph)
        if op == "bih":
            return lambda: jm.biharmonic(net, x, create_graph=graph)
        gen = torch.Generator().manual_seed(0)
        return lambda: jm.laplacian(net, x, samples=case["K"], generator=gen, create_graph=graph)
    if method == "forward":
        return lambda: net(x)
    f = lambda v: net(v)  # noqa: E731 -- jet's transforms and torch.func take one datum
    if method == "nested":
        return _nested(op, f, x, D)
    import jet
    from jet.weighted_laplacian import get_weighting

    randomization = ("rademacher", case["K"]) if op == "rlap" else None
    if op == "bih":
        g = jet.bilaplacian(f, (x[0],), collapsed=True)
    else:
        weighting = get_weighting(x[0], "diagonal_increments", randomization) if op == "wlap" else None
        g = jet.laplacian(f, (x[0],), collapsed=True, randomization=randomization, weighting=weighting)
    g, _ = jet.capture_graph(g, (x[0],))  # as jet's own benchmark ("jet_simplified"): CSE on the graph
    jet.common_subexpression_elimination(g.graph)
    g.recompile()
    batched = torch.func.vmap(g, randomness="error" if randomization is None else "different")
    return lambda: batched(x)


def _nested(op: str, f: Callable[[Tensor], Tensor], x: Tensor, D: int) -> Callable[[], Tensor]:
    """jet's "hessian_trace": vmap over samples of the forward-over-reverse Hessian's (weighted) trace."""
    from torch.func import hessian, vmap

    def lap(v: Tensor) -> Tensor:
        return hessian(f)(v).reshape(-1, D, D).diagonal(0, 1, 2).sum(-1)

    if op == "lap":
        fn = vmap(lap)
    elif op == "wlap":
        c = torch.arange(D, dtype=x.dtype) + 1  # C = diag(1..D): S = diag(sqrt(1..D)), jet's diagonal_increments
        fn = vmap(lambda v: (hessian(f)(v).reshape(-1, D, D).diagonal(0, 1, 2) * c).sum(-1))
    elif op == "bih":
        fn = vmap(lambda v: hessian(lap)(v).reshape(-1, D, D).diagonal(0, 1, 2).sum(-1))
    else:
        raise ValueError(op)
    return lambda: fn(x)


def _child(name: str, method: str, reps: int) -> None:
    torch.set_num_threads(1)
    case = CASES[name]
    net = _model(case)
    for p in net.parameters():
        p.requires_grad_(case.get("graph", False))
    x = torch.randn(case["B"], case["D"])
    grad = torch.enable_grad() if case.get("graph") else torch.no_grad()
    with grad:
        _setup(case, method, net, x[:4])()  # warm-up: tracing, capture, first-call costs
        fn = _setup(case, method, net, x)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = fn()
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        del out
        times = []
        for _ in range(reps):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
    print(json.dumps({"ms": 1000 * sorted(times)[len(times) // 2], "mib": peak}))


def _extra(reps: int) -> dict[str, float]:
    """The randomised Laplacian's relative standard error and its error against the exact value."""
    import jacmode as jm

    torch.set_num_threads(1)
    case = CASES["randomised laplacian"]
    net, x = _model(case), torch.randn(case["B"], case["D"])
    with torch.no_grad():
        exact = jm.laplacian(net, x)
        est, err = jm.laplacian(net, x, samples=case["K"], generator=torch.Generator().manual_seed(0), return_std=True)
    return {"median relative standard error": float((err / exact.abs()).median()),
            "relative error of the estimate (L2 over the batch)": float((est - exact).norm() / exact.norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("CASE", "METHOD"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.reps)
        return
    rows = []
    for name, case in CASES.items():
        if args.only and args.only not in name:
            continue
        found: dict[str, dict[str, float]] = {}
        for method in case["methods"]:
            reps = 3 if method == "nested" else args.reps
            run = subprocess.run([sys.executable, __file__, "--child", name, method, "--reps", str(reps)],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{name} / {method} failed:\n{run.stderr[-2000:]}", file=sys.stderr)
                continue
            found[method] = json.loads(run.stdout.strip().splitlines()[-1])
            print(name, method, found[method], flush=True)
        rows.append((name, case, found))
    lines = ["| workload | method | time (ms, CPU) | peak memory (MiB) | jacmode / this |", "|---|---|---|---|---|"]
    for name, case, found in rows:
        sizes = "-".join(str(s) for s in [case["D"], *case["layers"], 1])
        ours = found.get("jacmode")
        for method, r in found.items():
            ratio = "" if ours is None or method == "jacmode" else f"{ours['ms'] / r['ms']:.2f}x time, {ours['mib'] / max(r['mib'], 1e-9):.2f}x memory"
            lines.append(f"| {name}, {sizes}, B = {case['B']} | {method} | {r['ms']:.1f} | {r['mib']:.0f} | {ratio} |")
    if any("randomised" in name for name, _, _ in rows):
        for k, v in _extra(args.reps).items():
            lines.append(f"\nrandomised Laplacian, K = 16: {k} = {v:.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
