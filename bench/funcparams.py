"""Functional parameters side by side: a dict, the functional style, an ensemble, against torch.func.

Benchmark tooling, not part of the package. One torch thread, float32, problem 1's class
(784 -> 20 -> ReLU -> 10, P = 15,910): the median process CPU time of several calls after a
warm-up, for

* ``jm.jacobian(net, x, wrt="params")`` (the module's own parameters) and ``wrt=params`` (a dict of
  other tensors, new tensors every call as a functional optimiser makes them), against torch.func's
  ``vmap(jacrev(functional_call), in_dims=(None, 0))``;
* the functional style ``jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))`` with fn a
  ``functional_call`` (the probes fire) and a hand-written forward (the generic engines);
* ``per_sample_grads`` with a dict, against ``vmap(grad(...))``;
* an ensemble of 8 models: ``vmap`` over ``stack_module_state`` of ``jm.jacobian(base, x, wrt=p)``
  against torch.func's nested vmap.

    PYTHONPATH=src python bench/funcparams.py [--batch 64]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap

import jacmode as jm


def median_ms(fn: Callable[[], Any], repeat: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))
    x, y = torch.randn(args.batch, 784), torch.randn(args.batch, 10)
    own = {n: p.detach() for n, p in net.named_parameters()}

    def fresh() -> dict[str, Tensor]:
        return {n: p + 0.0 for n, p in own.items()}

    def fn(p: dict[str, Tensor], v: Tensor) -> Tensor:
        return functional_call(net, p, (v,))

    def by_hand(p: dict[str, Tensor], v: Tensor) -> Tensor:
        return torch.relu(v @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"]

    def loss(out: Tensor, t: Tensor) -> Tensor:
        return ((out - t) ** 2).sum(1)

    tf_jac = vmap(jacrev(lambda p, xb: fn(p, xb[None])[0]), in_dims=(None, 0))
    tf_psg = vmap(grad(lambda p, xb, yb: loss(fn(p, xb[None]), yb[None]).sum()), in_dims=(None, 0, 0))
    rows = [
        ("jacobian, own parameters", lambda: jm.jacobian(net, x, wrt="params")),
        ("jacobian, wrt=dict (new tensors per call)", lambda: jm.jacobian(net, x, wrt=fresh())),
        ("jacobian, fn(params, x) = functional_call", lambda: jm.jacobian(fn, fresh(), x, argnums=0, in_dims=(None, 0))),
        ("jacobian, fn(params, x) by hand", lambda: jm.jacobian(by_hand, fresh(), x, argnums=0, in_dims=(None, 0))),
        ("torch.func vmap(jacrev(functional_call))", lambda: tf_jac(fresh(), x)),
        ("per_sample_grads, own parameters", lambda: jm.per_sample_grads(net, x, loss, y=y)),
        ("per_sample_grads, wrt=dict", lambda: jm.per_sample_grads(net, x, loss, y=y, wrt=fresh())),
        ("torch.func vmap(grad(functional_call))", lambda: tf_psg(fresh(), x, y)),
    ]
    models = [copy.deepcopy(net) for _ in range(8)]
    for m in models:
        for p in m.parameters():
            p.data.add_(0.01 * torch.randn_like(p))
    stacked, _ = stack_module_state(models)
    base = copy.deepcopy(net).to("meta")
    tf_ens = vmap(lambda p: vmap(jacrev(lambda q, xb: functional_call(base, q, (xb[None],))[0]),
                                 in_dims=(None, 0))(p, x))
    rows += [
        ("ensemble of 8: vmap(jm.jacobian(base, x, wrt=p))", lambda: vmap(lambda p: jm.jacobian(base, x, wrt=p))(stacked)),
        ("ensemble of 8: loop of jm.jacobian over the models", lambda: [jm.jacobian(m, x, wrt="params") for m in models]),
        ("ensemble of 8: torch.func nested vmap", lambda: tf_ens(stacked)),
    ]
    print(f"problem 1's class, B = {args.batch}, P = 15,910, 1 thread, float32 (median CPU ms)")
    results = {name: median_ms(call) for name, call in rows}
    ref = {"jacobian": results["torch.func vmap(jacrev(functional_call))"],
           "per_sample": results["torch.func vmap(grad(functional_call))"],
           "ensemble": results["ensemble of 8: torch.func nested vmap"]}
    for name, ms in results.items():
        key = ("ensemble" if name.startswith("ensemble") else
               "per_sample" if "per_sample" in name or "grad(" in name else "jacobian")
        print(f"{name:55s} {ms:9.2f} ms  {ms / ref[key]:5.2f}x torch.func")


if __name__ == "__main__":
    main()
