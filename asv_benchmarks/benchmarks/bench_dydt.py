"""Suite 2: dy/dt at every time step, (B, 4), of problem 2's tanh MLP.

``TimeDerivative``: problem 2's class ``NetX`` (Linear(1, 20) -> torch.tanh -> Linear(20, 20) ->
torch.tanh -> Linear(20, 4)): the users' loop and the full Jacobian then its diagonal (both
B <= 1000), torch.autograd.grad with a cotangent of ones, torch.func.jvp with a tangent of ones,
jacmode.derivative and jacmode.jacobian.

``DydtTargets``: the issue's targets at B = 100,000, each jacmode call against one no-grad
forward pass of the same model, for the class and (second row) its ``nn.Sequential`` twin. Run
as plain Python for the side-by-side table of ratios::

    PYTHONPATH=src python asv_benchmarks/benchmarks/bench_dydt.py [--repeats 21] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import jacmode as jm
from bench.baselines import time_mlp, time_mlp_sequential

try:
    from ._common import _ProblemSuite, params_of
except ImportError:  # run as a script
    from _common import _ProblemSuite, params_of  # type: ignore[no-redef]

B_TARGETS = 100_000
MODELS = {"class": time_mlp, "sequential": time_mlp_sequential}


def _forward(net: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net(t)


CALLS: dict[str, Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], object]] = {
    "forward (no grad)": _forward,
    "jm.jacobian": lambda net, t: jm.jacobian(net, t),
    "jm.derivative": lambda net, t: jm.derivative(net, t),
    "jm.derivative order 2": lambda net, t: jm.derivative(net, t, order=2),
}


class TimeDerivative(_ProblemSuite):
    problem = "dydt"
    params = params_of("dydt")


class DydtTargets:
    """jm.jacobian and jm.derivative (orders 1, 2) against one forward pass, B = 100,000."""

    params = (list(MODELS), list(CALLS))
    param_names = ["model", "call"]
    timeout = 300

    def setup(self, model: str, call: str) -> None:
        torch.manual_seed(0)
        self.net, self.t = MODELS[model](), torch.rand(B_TARGETS, 1)
        self.call = CALLS[call]
        self.call(self.net, self.t[:2])

    def time_call(self, model: str, call: str) -> None:
        self.call(self.net, self.t)


def main() -> None:
    parser = argparse.ArgumentParser(description="dy/dt targets at B = 100,000, side by side")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={B_TARGETS}, medians of {args.repeats}, ms")
    benches = {(m, c): DydtTargets() for m in MODELS for c in CALLS}
    for (m, c), b in benches.items():
        b.setup(m, c)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in benches}
    for _ in range(args.repeats):  # interleaved: every method sees the same machine state
        for key, b in benches.items():
            start = time.perf_counter()
            b.time_call(*key)
            times[key].append(1e3 * (time.perf_counter() - start))
    med = {key: statistics.median(ts) for key, ts in times.items()}
    print("| model | " + " | ".join(CALLS) + " |")
    print("|---|" + "---|" * len(CALLS))
    for m in MODELS:
        fwd = med[(m, "forward (no grad)")]
        cells = [f"{med[(m, c)]:.2f}" + ("" if c.startswith("forward") else f" ({med[(m, c)] / fwd:.2f}x)") for c in CALLS]
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
