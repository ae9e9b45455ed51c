"""Generated probe code for problem 1's parameter Jacobian, side by side in one run.

Problem 1's ``MLP(784, 20, 10)``, ``jacobian(wrt="params")`` at B = 2 (and B = 64): the hand-derived
rule, the eager call and its transform (interpreted probe engine, generated code, generated code
compiled with Inductor) and the users' own loop, timed in shuffled rounds, 1 thread; medians in
microseconds and ratios to the hand rule.

Run: ``PYTHONPATH=src:. python -m bench.probe_codegen [--rounds N] [--batch B]``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any, Callable

import torch

import jacmode as jm
from jacmode._probes import generated
from bench.baselines import MLP, params_hand_rule, params_loop
from bench.timing import shuffled_us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = MLP(784, 20, 10)
    x = torch.randn(args.batch, 784)
    eager = lambda: jm.jacobian(net, x, wrt="params")  # noqa: E731
    jac = jm.jacfn(net, wrt="params")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        comp = jm.transform(jm.jacobian, net, wrt="params", compile=True)
        comp(x)
        first_compiled = time.perf_counter() - t0

    def interpreted() -> Any:
        with generated.disabled():
            return jm.jacobian(net, x, wrt="params")

    cases = {"hand rule": lambda: params_hand_rule(net, x), "eager interpreted": interpreted,
             "eager generated": eager, "transform generated": lambda: jac(x), "transform compiled": lambda: comp(x),
             "users' loop": lambda: params_loop(net, x)}
    for fn in cases.values():
        for _ in range(5):
            fn()
    want = params_hand_rule(net, x)
    for name in ("eager generated", "transform generated", "transform compiled"):
        torch.testing.assert_close(cases[name](), want, rtol=1e-5, atol=1e-6)
    res = shuffled_us(cases, 10 * args.rounds)[0]  # args.rounds rounds of 10 calls of each case
    hand = res["hand rule"]
    print(f"problem 1, MLP(784, 20, 10), B = {args.batch}, jacobian(wrt='params'), 1 thread, medians (us)")
    for k, v in res.items():
        print(f"  {k:<22} {v:9.1f} us  {v / hand:5.2f}x the hand rule")
    loop = res["users' loop"]
    print(f"  eager generated is {loop / res['eager generated']:.1f}x faster than the users' loop")
    print(f"  first call of the compiled transform (trace + Inductor): {first_compiled:.2f} s")


if __name__ == "__main__":
    main()
