"""jm.hessian's two engines side by side, and torch.func: python -m bench.hessian_engines [--dims 2 4 8]

Forces the pairs (Taylor mode, D (D + 1) / 2 directions) and the rows (forward over reverse, D
directions per output) through ``_derivatives.ROW_COST`` and prints medians (1 thread) for
the tanh MLP D -> 64 -> 64 -> Y on B samples, with torch.func's ``vmap(hessian)``. The crossover
where the rows start to win sets ``ROW_COST`` (see the note [Rows or pairs] in _derivatives.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import jacmode as jm
from jacmode import _derivatives


class Opaque:
    """A callable that is neither a module nor a function: never captured."""

    def __init__(self, f) -> None:
        self.f = f

    def __call__(self, x):
        return self.f(x)


def median(fn, repeat: int) -> float:
    fn()  # warm-up (capture, profile)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--outputs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-pairs-above", type=int, default=10**9)
    ap.add_argument("--opaque", action="store_true", help="hide the model behind a callable object: the "
                    "generic engines (nested forward mode for the pairs) instead of Taylor mode")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    saved = _derivatives.ROW_COST
    print(f"B = {a.batch}, Y = {a.outputs}, medians of {a.repeat}, 1 thread, "
          f"{'generic engines' if a.opaque else 'captured (Taylor pairs)'}")
    print(f"{'D':>5} {'pairs s':>9} {'rows s':>9} {'auto s':>9} {'torch.func s':>13} {'pairs/rows':>11}")
    for d in a.dims:
        net = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                  torch.nn.Linear(64, a.outputs))
        x = torch.randn(a.batch, d)
        f = Opaque(net) if a.opaque else net
        res = {}
        for name, r in (("pairs", 1e30), ("rows", 0.0), ("auto", saved)):
            if name == "pairs" and d > a.skip_pairs_above:
                res[name] = float("nan")
                continue
            _derivatives.ROW_COST = r
            try:
                res[name] = median(lambda: jm.hessian(f, x), a.repeat)
            finally:
                _derivatives.ROW_COST = saved
        tf = torch.func.vmap(torch.func.hessian(lambda v: net(v[None])[0]))
        res["tf"] = median(lambda: tf(x), a.repeat)
        print(f"{d:>5} {res['pairs']:>9.3f} {res['rows']:>9.3f} {res['auto']:>9.3f} {res['tf']:>13.3f} "
              f"{res['pairs'] / res['rows']:>11.2f}")


if __name__ == "__main__":
    main()
