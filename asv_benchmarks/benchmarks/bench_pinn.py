"""PINN derivative operators against the hand-written idioms they replace (asv suite).

Three workloads, each with ``create_graph=True`` as in PINN training:

* ``PinnFirstSecond``: u_t and u_xx of a tanh MLP 2 -> 64 -> 64 -> 1 at B = 10,000.
* ``PinnLaplacian``: the Laplacian of a tanh MLP 10 -> 64 -> 64 -> 1 at B = 4096.
* ``PinnOrders``: d^k u / dt^k, k = 1..4, of a tanh MLP 1 -> 64 -> 64 -> 1 at B = 10,000.

Methods: ``jacmode`` (the Taylor fast path an ``nn.Sequential`` gets), ``jacmode_generic`` (the
same network behind a lambda, so nested forward mode), ``grad_ones`` / ``nested_backprop`` (the
torch.autograd.grad idioms with a cotangent of ones) and ``loop`` (one sample at a time, timed on
``LOOP_SAMPLES`` samples: scale by B / LOOP_SAMPLES for the whole batch).

Run as plain Python for the side-by-side table of ratios quoted in docs/pinn.md::

    PYTHONPATH=src python asv_benchmarks/benchmarks/bench_pinn.py [--repeats 15] [--quick]
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

B_FIRST_SECOND = 10_000
B_LAPLACIAN = 4096
B_ORDERS = 10_000
LOOP_SAMPLES = 200
DIMS = {"u_t": (0,), "u_xx": (1, 1)}


def tanh_mlp(d_in: int, width: int = 64, d_out: int = 1) -> nn.Sequential:
    """Linear(d_in, width) -> tanh -> Linear(width, width) -> tanh -> Linear(width, d_out)."""
    return nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, d_out))


def _leaf(x: Tensor) -> Tensor:
    return x if x.requires_grad else x.detach().requires_grad_(True)


def grad_ones(net: Callable[[Tensor], Tensor], x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """The idiom: torch.autograd.grad with a cotangent of ones, once per order (single output)."""
    x = _leaf(x)
    g = net(x)
    for d in dims:
        g = torch.autograd.grad(g, x, torch.ones_like(g), create_graph=True)[0][:, d : d + 1]
    return g


def loop(net: Callable[[Tensor], Tensor], x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """One sample at a time, as a user without the batch trick writes it."""
    rows = []
    for b in range(x.shape[0]):
        xb = x[b : b + 1].detach().requires_grad_(True)
        g = net(xb)
        for d in dims:
            g = torch.autograd.grad(g.sum(), xb, create_graph=True)[0][:, d]
        rows.append(g)
    return torch.stack(rows)


def nested_backprop_laplacian(net: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """The idiom: one grad for the gradient, then one grad per coordinate for its diagonal."""
    x = _leaf(x)
    u = net(x)
    g = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
    ones = torch.ones_like(g[:, 0])
    return sum(torch.autograd.grad(g[:, d], x, ones, create_graph=True)[0][:, d]
               for d in range(x.shape[1]))


def _generic(net: nn.Module) -> Callable[[Tensor], Tensor]:
    return lambda x: net(x)  # hides the Sequential: jacmode takes the nested forward path


PARTIAL = {
    "jacmode": lambda net, x, dims: jm.partial(net, x, dims, create_graph=True),
    "jacmode_generic": lambda net, x, dims: jm.partial(net, x, dims, create_graph=True),
    "grad_ones": grad_ones,
    "loop": loop,
}
LAPLACIAN = {
    "jacmode": lambda net, x: jm.laplacian(net, x, create_graph=True),
    "jacmode_generic": lambda net, x: jm.laplacian(net, x, create_graph=True),
    "nested_backprop": nested_backprop_laplacian,
}
ORDERS = {
    "jacmode": lambda net, t, k: jm.derivative(net, t, k, create_graph=True),
    "jacmode_generic": lambda net, t, k: jm.derivative(net, t, k, create_graph=True),
    "grad_ones": lambda net, t, k: grad_ones(net, t, (0,) * k),
}


class PinnFirstSecond:
    """u_t and u_xx of a tanh MLP 2 -> 64 -> 64 -> 1 at B = 10,000, create_graph=True."""

    params = (["u_t", "u_xx"], list(PARTIAL))
    param_names = ["operator", "method"]
    timeout = 300

    def setup(self, operator: str, method: str) -> None:
        torch.manual_seed(0)
        self.net = tanh_mlp(2)
        self.f = _generic(self.net) if method == "jacmode_generic" else self.net
        n = LOOP_SAMPLES if method == "loop" else B_FIRST_SECOND
        self.x = torch.rand(n, 2)
        self.dims, self.call = DIMS[operator], PARTIAL[method]

    def time_call(self, operator: str, method: str) -> None:
        self.call(self.f, self.x, self.dims)

    def time_train_step(self, operator: str, method: str) -> None:
        self.call(self.f, self.x, self.dims).square().mean().backward()

    def peakmem_call(self, operator: str, method: str) -> None:
        self.call(self.f, self.x, self.dims)


class PinnLaplacian:
    """Laplacian of a tanh MLP D -> 64 -> 64 -> 1 at B = 4096, create_graph=True."""

    params = ([10], list(LAPLACIAN))
    param_names = ["D", "method"]
    timeout = 300

    def setup(self, d: int, method: str) -> None:
        torch.manual_seed(0)
        self.net = tanh_mlp(d)
        self.f = _generic(self.net) if method == "jacmode_generic" else self.net
        self.x = torch.rand(B_LAPLACIAN, d)
        self.call = LAPLACIAN[method]

    def time_call(self, d: int, method: str) -> None:
        self.call(self.f, self.x)

    def time_train_step(self, d: int, method: str) -> None:
        self.call(self.f, self.x).square().mean().backward()

    def peakmem_call(self, d: int, method: str) -> None:
        self.call(self.f, self.x)


class PinnOrders:
    """d^k u / dt^k of a tanh MLP 1 -> 64 -> 64 -> 1 at B = 10,000, create_graph=True."""

    params = ([1, 2, 3, 4], list(ORDERS))
    param_names = ["order", "method"]
    timeout = 300

    def setup(self, order: int, method: str) -> None:
        torch.manual_seed(0)
        self.net = tanh_mlp(1)
        self.f = _generic(self.net) if method == "jacmode_generic" else self.net
        self.t = torch.rand(B_ORDERS, 1)
        self.call = ORDERS[method]

    def time_call(self, order: int, method: str) -> None:
        self.call(self.f, self.t, order)

    def peakmem_call(self, order: int, method: str) -> None:
        self.call(self.f, self.t, order)


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


def _peak_child(suite: str, params: tuple, threads: int, queue: "multiprocessing.Queue[float]") -> None:
    torch.set_num_threads(threads)
    bench = {"PinnLaplacian": PinnLaplacian, "PinnFirstSecond": PinnFirstSecond}[suite]()
    bench.setup(*params)
    with open("/proc/self/clear_refs", "w") as refs:  # reset the peak (VmHWM) to the current RSS
        refs.write("5")
    before = _vm("VmRSS")
    result = bench.call(bench.f, bench.x, *([bench.dims] if suite == "PinnFirstSecond" else []))
    queue.put(_vm("VmHWM") - before)
    del result


def peak_mib(suite: str, *params: object) -> float:
    """Peak resident memory added by one call (result and its graph alive), in a fresh process.

    Linux only: the peak resident set size is reset before the call through /proc/self/clear_refs.
    """
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(suite, params, torch.get_num_threads(), queue))
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

    print(f"\nu_t and u_xx, tanh MLP 2-64-64-1, B={B_FIRST_SECOND}, create_graph=True")
    print("| operator | jacmode | jacmode generic | grad with ones | loop (scaled) | idiom / jacmode "
          "| loop / jacmode | step: jacmode | step: grad ones |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op in DIMS:
        benches = {m: PinnFirstSecond() for m in PARTIAL}
        for m, b in benches.items():
            b.setup(op, m)
        calls = {m: (lambda b=b: b.time_call(op, "")) for m, b in benches.items() if m != "loop"}
        steps = {m: (lambda b=b: b.time_train_step(op, "")) for m, b in benches.items()
                 if m in ("jacmode", "grad_ones")}
        t = _median_ms(calls, repeats)
        s = _median_ms(steps, repeats)
        lp = _median_ms({"loop": lambda: benches["loop"].time_call(op, "")}, max(1, repeats // 5))["loop"]
        lp *= B_FIRST_SECOND / LOOP_SAMPLES
        print(f"| {op} | {t['jacmode']:.2f} | {t['jacmode_generic']:.2f} | {t['grad_ones']:.2f} | {lp:.0f} | "
              f"{t['grad_ones'] / t['jacmode']:.2f}x | {lp / t['jacmode']:.0f}x | {s['jacmode']:.2f} | "
              f"{s['grad_ones']:.2f} |")

    print(f"\nLaplacian, tanh MLP 10-64-64-1, B={B_LAPLACIAN}, create_graph=True")
    benches = {m: PinnLaplacian() for m in LAPLACIAN}
    for m, b in benches.items():
        b.setup(10, m)
    t = _median_ms({m: (lambda b=b: b.time_call(10, "")) for m, b in benches.items()}, repeats)
    s = _median_ms({m: (lambda b=b: b.time_train_step(10, "")) for m, b in benches.items()}, repeats)
    mem = {m: (float("nan") if args.quick else peak_mib("PinnLaplacian", 10, m)) for m in LAPLACIAN}
    print("| method | call ms | call+backward ms | peak MiB (call) | nested backprop / method (call) |")
    print("|---|---|---|---|---|")
    for m in LAPLACIAN:
        print(f"| {m} | {t[m]:.2f} | {s[m]:.2f} | {mem[m]:.0f} | {t['nested_backprop'] / t[m]:.2f}x |")

    print(f"\nd^k u/dt^k, tanh MLP 1-64-64-1, B={B_ORDERS}, create_graph=True (ms, and cost / order 1)")
    benches = {(k, m): PinnOrders() for k in (1, 2, 3, 4) for m in ORDERS}
    for (k, m), b in benches.items():
        b.setup(k, m)
    t = _median_ms({key: (lambda b=b, k=key[0]: b.time_call(k, "")) for key, b in benches.items()}, repeats)
    print("| order | " + " | ".join(ORDERS) + " |")
    print("|---|" + "---|" * len(ORDERS))
    for k in (1, 2, 3, 4):
        cells = [f"{t[(k, m)]:.2f} ({t[(k, m)] / t[(1, m)]:.2f}x)" for m in ORDERS]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
