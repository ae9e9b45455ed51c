"""PINN derivative operators against the hand-written idioms they replace (asv suite).

Timed on the PINN class as users write it (``bench.baselines.PinnNet``: Linear layers and
``torch.tanh`` in ``forward``), with its ``nn.Sequential`` twin as a second row (``model``
parameter), every call with ``create_graph=True`` as in PINN training:

* ``PinnTrainStep``: one training step of u_t - 0.1 u_xx on PinnNet(2, 64, 2) (2-64-64-1) at
  B = 10,000: the derivatives, a squared residual, ``.backward()``.
* ``PinnLaplacian``: the Laplacian of PinnNet(10, 64, 2) at B = 4096.
* ``PinnOrders``: d^k u / dt^k, k = 1..4, of PinnNet(1, 64, 2) at B = 10,000.
* ``PinnUnknownOp``: u_xx of a PINN with one operation without a rule (cumsum), against the
  generic engine on the same model.

Methods: ``partials`` (``jm.partials``, one propagation for u_t and u_xx), ``partial`` (two
``jm.partial`` calls), ``jacmode`` (one operator call), ``generic`` (the same model behind
``baselines.Opaque``, which jacmode cannot capture: nested forward mode), ``grad_ones`` /
``nested_backprop`` (the torch.autograd.grad idioms with a cotangent of ones).

Run as plain Python for the side-by-side table of ratios quoted in docs/pinn.md::

    PYTHONPATH=src python asv_benchmarks/benchmarks/bench_pinn.py [--repeats 15] [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Callable

import torch
from torch import Tensor, nn

import jacmode as jm
from bench.baselines import CumsumNet, Opaque, PinnNet, pinn_sequential

B_STEP = 10_000
B_LAPLACIAN = 4096
B_ORDERS = 10_000
NU = 0.1
MODELS = {"class": PinnNet, "sequential": pinn_sequential}


def _leaf(x: Tensor) -> Tensor:
    return x if x.requires_grad else x.detach().requires_grad_(True)


def idiom_residual(net: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """The idiom: autograd.grad with ones for (u_t, u_x), then again for u_xx."""
    x = _leaf(x)
    u = net(x)
    g = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
    u_t, u_x = g[:, :1], g[:, 1:2]
    u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0][:, 1:2]
    return u_t - NU * u_xx


def grad_ones(net: Callable[[Tensor], Tensor], x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """autograd.grad with a cotangent of ones, once per order (single output)."""
    x = _leaf(x)
    g = net(x)
    for d in dims:
        g = torch.autograd.grad(g, x, torch.ones_like(g), create_graph=True)[0][:, d : d + 1]
    return g


def nested_backprop_laplacian(net: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """The idiom: one grad for the gradient, then one grad per coordinate for its diagonal."""
    x = _leaf(x)
    u = net(x)
    g = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
    ones = torch.ones_like(g[:, 0])
    return sum(torch.autograd.grad(g[:, d], x, ones, create_graph=True)[0][:, d]
               for d in range(x.shape[1]))


def _partials(net: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    u_t, u_xx = jm.partials(net, x, [(0,), (1, 1)], create_graph=True)
    return u_t - NU * u_xx


def _two_partial(net: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return jm.partial(net, x, (0,), create_graph=True) - NU * jm.partial(net, x, (1, 1), create_graph=True)


RESIDUAL = {"partials": _partials, "partial": _two_partial, "generic": _partials, "grad_ones": idiom_residual}
LAPLACIAN = {
    "jacmode": lambda net, x: jm.laplacian(net, x, create_graph=True),
    "generic": lambda net, x: jm.laplacian(net, x, create_graph=True),
    "nested_backprop": nested_backprop_laplacian,
}
ORDERS = {
    "jacmode": lambda net, t, k: jm.derivative(net, t, k, create_graph=True),
    "generic": lambda net, t, k: jm.derivative(net, t, k, create_graph=True),
    "grad_ones": lambda net, t, k: grad_ones(net, t, (0,) * k),
}


def _model(model: str, method: str, *args: int) -> nn.Module:
    torch.manual_seed(0)
    net = MODELS[model](*args)
    return Opaque(net) if method == "generic" else net


class PinnTrainStep:
    """One training step of u_t - 0.1 u_xx, PinnNet(2, 64, 2), B = 10,000."""

    params = (list(MODELS), list(RESIDUAL))
    param_names = ["model", "method"]
    timeout = 300

    def setup(self, model: str, method: str) -> None:
        self.f = _model(model, method, 2, 64, 2)
        self.x = torch.rand(B_STEP, 2)
        self.call = RESIDUAL[method]

    def time_train_step(self, model: str, method: str) -> None:
        self.call(self.f, self.x).square().mean().backward()

    def peakmem_residual(self, model: str, method: str) -> None:
        self.call(self.f, self.x)


class PinnLaplacian:
    """Laplacian of PinnNet(10, 64, 2), B = 4096, create_graph=True."""

    params = (list(MODELS), list(LAPLACIAN))
    param_names = ["model", "method"]
    timeout = 300

    def setup(self, model: str, method: str) -> None:
        self.f = _model(model, method, 10, 64, 2)
        self.x = torch.rand(B_LAPLACIAN, 10)
        self.call = LAPLACIAN[method]

    def time_call(self, model: str, method: str) -> None:
        self.call(self.f, self.x)

    def time_train_step(self, model: str, method: str) -> None:
        self.call(self.f, self.x).square().mean().backward()

    def peakmem_call(self, model: str, method: str) -> None:
        self.call(self.f, self.x)


class PinnOrders:
    """d^k u / dt^k of PinnNet(1, 64, 2), B = 10,000, create_graph=True."""

    params = ([1, 2, 3, 4], list(ORDERS))
    param_names = ["order", "method"]
    timeout = 300

    def setup(self, order: int, method: str) -> None:
        self.f = _model("class", method, 1, 64, 2)
        self.t = torch.rand(B_ORDERS, 1)
        self.call = ORDERS[method]

    def time_call(self, order: int, method: str) -> None:
        self.call(self.f, self.t, order)


class PinnUnknownOp:
    """u_xx of a PINN with one op without a rule (cumsum): jacmode against its generic engine."""

    params = (["jacmode", "generic"],)
    param_names = ["method"]
    timeout = 300

    def setup(self, method: str) -> None:
        torch.manual_seed(0)
        net = CumsumNet(2, 64, 2)
        self.f = Opaque(net) if method == "generic" else net
        self.x = torch.rand(B_STEP, 2)

    def time_call(self, method: str) -> None:
        jm.partial(self.f, self.x, (1, 1), create_graph=True)


# ---------------------------------------------------------------------------------------------
# Side-by-side table (plain Python): every method of a row is timed in the same interleaved loop.


def _median_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def _vm(key: str) -> float:
    """A line of /proc/self/status in MiB (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _peak_child(model: str, method: str, threads: int, queue: "multiprocessing.Queue[float]") -> None:
    torch.set_num_threads(threads)
    bench = PinnLaplacian()
    bench.setup(model, method)
    with open("/proc/self/clear_refs", "w") as refs:  # reset the peak (VmHWM) to the current RSS
        refs.write("5")
    before = _vm("VmRSS")
    result = bench.call(bench.f, bench.x)
    queue.put(_vm("VmHWM") - before)
    del result


def peak_mib(model: str, method: str) -> float:
    """Peak resident memory added by one Laplacian call (result and its graph alive), in a fresh
    process. Linux only: the peak resident set size is reset through /proc/self/clear_refs."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(model, method, torch.get_num_threads(), queue))
    proc.start()
    value = queue.get()
    proc.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 repeats, no memory")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {repeats}, ms")

    print(f"\nTraining step u_t - {NU} u_xx, PinnNet(2, 64, 2), B={B_STEP} (derivatives, loss, backward)")
    print("| model | jm.partials | two jm.partial | generic engine | autograd idiom | idiom / partials | idiom / two partial |")
    print("|---|---|---|---|---|---|---|")
    for model in MODELS:
        benches = {m: PinnTrainStep() for m in RESIDUAL}
        for m, b in benches.items():
            b.setup(model, m)
        t = _median_ms({m: (lambda b=b: b.time_train_step("", "")) for m, b in benches.items()}, repeats)
        print(f"| {model} | {t['partials']:.2f} | {t['partial']:.2f} | {t['generic']:.2f} | {t['grad_ones']:.2f} | "
              f"{t['grad_ones'] / t['partials']:.2f}x | {t['grad_ones'] / t['partial']:.2f}x |")

    print(f"\nLaplacian, PinnNet(10, 64, 2), B={B_LAPLACIAN}, create_graph=True")
    print("| model | method | call ms | call+backward ms | peak MiB (call) | nested backprop / method (call) |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        benches = {m: PinnLaplacian() for m in LAPLACIAN}
        for m, b in benches.items():
            b.setup(model, m)
        t = _median_ms({m: (lambda b=b: b.time_call("", "")) for m, b in benches.items()}, repeats)
        s = _median_ms({m: (lambda b=b: b.time_train_step("", "")) for m, b in benches.items()}, repeats)
        mem = {m: (float("nan") if args.quick else peak_mib(model, m)) for m in LAPLACIAN}
        for m in LAPLACIAN:
            print(f"| {model} | {m} | {t[m]:.2f} | {s[m]:.2f} | {mem[m]:.0f} | {t['nested_backprop'] / t[m]:.2f}x |")

    print(f"\nd^k u/dt^k, PinnNet(1, 64, 2), B={B_ORDERS}, create_graph=True (ms, and cost / order 1)")
    orders = {(k, m): PinnOrders() for k in (1, 2, 3, 4) for m in ORDERS}
    for (k, m), b in orders.items():
        b.setup(k, m)
    t = _median_ms({key: (lambda b=b, k=key[0]: b.time_call(k, "")) for key, b in orders.items()}, repeats)
    print("| order | " + " | ".join(ORDERS) + " |")
    print("|---|" + "---|" * len(ORDERS))
    for k in (1, 2, 3, 4):
        cells = [f"{t[(k, m)]:.2f} ({t[(k, m)] / t[(1, m)]:.2f}x)" for m in ORDERS]
        print(f"| {k} | " + " | ".join(cells) + " |")

    print(f"\nOne op without a rule (cumsum), u_xx with create_graph, B={B_STEP}")
    unknown = {m: PinnUnknownOp() for m in ("jacmode", "generic")}
    for m, b in unknown.items():
        b.setup(m)
    t = _median_ms({m: (lambda b=b: b.time_call("")) for m, b in unknown.items()}, repeats)
    print(f"| jacmode {t['jacmode']:.2f} ms | generic engine {t['generic']:.2f} ms | ratio {t['jacmode'] / t['generic']:.3f} |")


if __name__ == "__main__":
    main()
