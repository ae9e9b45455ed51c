"""Generated code and torch.compile for the Taylor engine, side by side.

Variants, timed round-robin in one run (medians, 1 thread by default):
  interp  -- today's engine: the captured program interpreted op by op (codegen.ENABLED = False)
  gen     -- generated code (make_fx of the interpreter, fused), no compiler
  comp    -- generated code compiled with torch.compile(backend="inductor", dynamic=False)
and each workload's reference (a no-grad forward pass, nested backprop, the autograd idiom).
The first call of each variant (fresh model: capture, check, code generation, compilation) is
timed on its own.

    PYTHONPATH=src python -m bench.compile [threads] [B for net_x, default 100000] [sections]

sections: a comma list of netx, lap, train (all by default).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
import warnings
from typing import Callable, Iterator

import torch
from torch import nn

import jacmode as jm
from jacmode._capture import codegen
from bench.baselines import PinnNet

warnings.filterwarnings("ignore")


class net_x(nn.Module):  # noqa: N801 -- problem 2's class, as written there
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(1, 20), nn.Linear(20, 20), nn.Linear(20, 4)

    def forward(self, x):
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.out(x)


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    if name == "interp":
        codegen.ENABLED = False
        try:
            yield
        finally:
            codegen.ENABLED = True
    elif name == "gen":
        with codegen.generated():
            yield
    elif name == "comp":
        with codegen.generated("inductor"):
            yield
    else:
        yield


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(cases: dict[str, Callable[[], object]], budget: float = 6.0) -> dict[str, float]:
    """Median ms of each case, timed round-robin."""
    for fn in cases.values():
        fn()
    one = sum(timed(fn) for fn in cases.values())
    reps = max(5, min(200, int(budget / max(one, 1e-6))))
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for k, fn in cases.items():
            times[k].append(timed(fn))
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def show(title: str, ms: dict[str, float], ref: str, first: dict[str, float]) -> None:
    print(f"\n{title}")
    for k, v in ms.items():
        ratio = v / ms[ref]
        extra = f"   first call {first[k]:8.1f} ms" if k in first else ""
        print(f"  {k:28s} {v:9.2f} ms   {ratio:5.2f}x {ref}{extra}")


def in_variant(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with variant(name):
            return fn()
    return run


def variants(base: nn.Module, label: str, call: Callable[[nn.Module], object], ref: str,
             baseline: Callable[[], object]) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """The cases ``ref`` (the baseline) and ``call`` on a copy of ``base`` per variant, and each
    variant's first call in ms (timed once, before the cases run)."""
    def on(v: str, net: nn.Module) -> Callable[[], object]:
        return in_variant(v, lambda: call(net))

    runs = {f"{v} {label}": on(v, copy.deepcopy(base)) for v in ("interp", "gen", "comp")}
    first = {k: 1e3 * timed(fn) for k, fn in runs.items()}
    return {ref: baseline, **runs}, first


def netx(batch: int) -> None:
    torch.manual_seed(0)
    base = net_x()
    t = torch.linspace(0, 10, batch).unsqueeze(1)

    def forward() -> object:
        with torch.no_grad():
            return base(t)

    for order in (2, 4):
        cases, first = variants(base, f"order={order}", lambda n: jm.derivative(n, t, order=order),
                                "forward (no grad)", forward)
        show(f"net_x B={batch}: derivative(order={order}) / one no-grad forward "
             f"(targets: comp <= {2 if order == 2 else 3.5}x, gen no worse than interp)", side_by_side(cases),
             "forward (no grad)", first)


def lap() -> None:
    torch.manual_seed(0)
    base = PinnNet(10, 64, 2)
    x = torch.rand(4096, 10)

    def nested() -> object:
        xx = x.clone().requires_grad_(True)
        u = base(xx)
        g = torch.autograd.grad(u.sum(), xx, create_graph=True)[0]
        return sum(torch.autograd.grad(g[:, i].sum(), xx, create_graph=True)[0][:, i] for i in range(10))

    cases, first = variants(base, "laplacian", lambda n: jm.laplacian(n, x), "nested backprop", nested)
    show("PinnNet(10, 64, 2) B=4096 laplacian (target: comp >= 5x faster than nested backprop)",
         side_by_side(cases), "nested backprop", first)


def train() -> None:
    torch.manual_seed(0)
    base = PinnNet(2, 64, 2)
    x = torch.rand(10_000, 2)

    def idiom() -> None:
        xx = x.clone().requires_grad_(True)
        u = base(xx)
        g = torch.autograd.grad(u, xx, torch.ones_like(u), create_graph=True)[0]
        u_t, u_x = g[:, :1], g[:, 1:2]
        u_xx = torch.autograd.grad(u_x, xx, torch.ones_like(u_x), create_graph=True)[0][:, 1:2]
        ((u_t - 0.1 * u_xx) ** 2).mean().backward()

    def step(net: nn.Module) -> None:
        u_t, u_xx = jm.partials(net, x, [(0,), (1, 1)], create_graph=True)
        ((u_t - 0.1 * u_xx) ** 2).mean().backward()

    cases, first = variants(base, "partials step", step, "autograd idiom", idiom)
    ms = side_by_side(cases)
    show("PinnNet(2, 64, 2) B=10000 training step, u_t and u_xx with create_graph, then backward "
         "(targets: comp >= 2x, eager >= 1.5x faster than the idiom)", ms, "autograd idiom", first)
    for k, v in ms.items():
        print(f"  speed-up of {k:28s} over the idiom: {ms['autograd idiom'] / v:5.2f}x")


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else ["netx", "lap", "train"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    if "netx" in only:
        netx(batch)
    if "lap" in only:
        lap()
    if "train" in only:
        train()


if __name__ == "__main__":
    main()
