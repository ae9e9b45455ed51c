"""The work of a repeated call around its engine, counted: Python and C function calls.

A deterministic companion of ``bench/callpath.py``, whose timings a loaded machine blurs: for each
entry point with a fixed-cost target (<= 50 us), the number of Python frames and C calls
(``sys.setprofile``) that one repeated identical call makes outside its engine (``execute``,
the generated code's ``codegen.run``, ``per_sample_grads_layers``, each counted as one call).
Attribute reads of tensors (shape, dtype, device) are not calls and do not count.

Run: ``PYTHONPATH=src python -m bench.callpath_calls [ENTRY POINT ...]``; naming entry points
(e.g. ``"jacobian params"``) also lists where the calls are made.
"""
from __future__ import annotations

import collections
import sys
from typing import Any, Callable

import torch

import jacmode as jm
from jacmode._planning import decide
from jacmode._capture import codegen
from jacmode._probes import products as pe
from bench.baselines import MLP, PinnNet
torch.set_num_threads(1)
torch.manual_seed(0)
net = MLP(784, 20, 10)
x, y = torch.randn(2, 784), torch.randn(2, 10)
pinn = PinnNet(2, 64, 2)
xp = torch.randn(16, 2)
dims = [(0,), (1, 1)]


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum(1)


ENGINES = {decide.execute.__code__, codegen.run.__code__, pe.per_sample_grads_layers.__code__}
jac_p = jm.transform(jm.jacobian, net, wrt="params")
jac_i = jm.transform(jm.jacobian, net)
parts = jm.transform(jm.partials, pinn, dims=dims)
lap = jm.transform(jm.laplacian, pinn)
psg = jm.transform(jm.per_sample_grads, net, loss=loss)
cases: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "jacobian params": (lambda: jm.jacobian(net, x, wrt="params"), lambda: jac_p(x)),
    "jacobian inputs": (lambda: jm.jacobian(net, x), lambda: jac_i(x)),
    "partials": (lambda: jm.partials(pinn, xp, dims), lambda: parts(xp)),
    "laplacian": (lambda: jm.laplacian(pinn, xp), lambda: lap(xp)),
    "per_sample_grads": (lambda: jm.per_sample_grads(net, x, loss, y=y), lambda: psg(x, y)),
}


def count(fn: Callable[[], Any], detail: bool = False) -> int:
    """The calls one call of ``fn`` makes outside the engines, once repeated calls run straight away
    (after the calls that generate the code, ``codegen.AFTER_CALLS``, and the one that keeps it ready)."""
    for _ in range(codegen.AFTER_CALLS + 3):  # (+1: the first call of a function caches nothing, _guard.py)
        fn()
    n, depth = [0], [0]
    where: collections.Counter[str] = collections.Counter()

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            if frame.f_code in ENGINES:
                depth[0] += 1
            elif depth[0] == 0:
                n[0] += 1
                where[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "return" and frame.f_code in ENGINES:
            depth[0] -= 1
        elif event == "c_call" and depth[0] == 0:
            n[0] += 1
            where[f"C:{getattr(arg, '__qualname__', arg)}"] += 1
    sys.setprofile(prof)
    fn()
    sys.setprofile(None)
    if detail:
        for k, v in where.most_common(400):
            print(f"   {v:3d} {k}")
    return n[0]


def main() -> None:
    sel = sys.argv[1:]
    for name, (e, t) in cases.items():
        if sel and name not in sel:
            continue
        print(f"{name:18s} eager {count(e, bool(sel)):5d} calls   transform {count(t):5d}")


if __name__ == "__main__":
    main()
