"""The cost of a repeated call around its engine, side by side in one run (target: fixed cost <= 50 us).

For each entry point: the median time of a repeated identical eager call, of the same call through
its transform (``jm.transform``), and of its engine alone (no checks, no state guard, no lookup):

* ``jacobian``: the generated probe code the call's profile holds, called with the tensors it
  reads (``_jacobian._direct``: a repeated parameter Jacobian runs only that); elsewhere the
  strategy's engine (``_structure.run``: the probe engine, or Taylor mode's columns) on the
  problem the call's profile holds, made once (``again``) outside the timing;
  ``execute``'s retry loop and warnings context are the call's, not the engine's;
* ``partials`` / ``laplacian``: the generated code of the captured program (``_capture/codegen``),
  called with the tensors it reads, read once: the look-up of that code (its key over the
  program's tensors and settings) is the call's; where no code was generated, ``Target.run``;
* ``per_sample_grads``: the probe engine's ``per_sample_grads_layers`` on the profile's coverage
  with a preallocated (B, P).

The fixed cost of the call is (call - engine alone). The column ``engine fn`` times the engine
*functions* the first version of this script called (``execute`` on the problem, ``Target.run``):
``fixed vs fn`` is the call minus those (their own Python then counts as engine). For problem 1's
``MLP(784, 20, 10)`` at B = 2,
``jacobian(wrt="params")`` is also compared with the hand-derived rule and the users' own loop, and
the first call of every entry point (profile, capture, checks) is timed once after
``jm.clear_cache()``.

All cases are timed in rounds (each case ten calls in a row, the cases in a new random order
every round), 1 thread, so that the load of the machine affects them alike; medians in microseconds.

Run: ``PYTHONPATH=src python -m bench.callpath [--rounds N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import jacmode as jm
from jacmode import _profile
from jacmode._checks import check_options
from jacmode._jacobian import JacobianEntry
from jacmode._operands import target
from jacmode._capture import codegen
from jacmode._planning.decide import execute
from jacmode._structure import run
from jacmode._problem import again
from jacmode._probes import layerio
from jacmode._probes import products as _products_engine
from bench.baselines import MLP, PinnNet, params_hand_rule, params_loop
from bench.timing import shuffled_us


def _jacobian_profile(f: Any, kind: str) -> Any:
    """f's profile of jacobian for a problem of ``kind`` ("inputs", "params")."""
    for prof in _profile._PROFILES.get(f, {}).values():
        if isinstance(prof.facts, JacobianEntry) and prof.facts.problem.kind == kind:
            return prof
    raise LookupError(kind)


def _jacobian_engine(net: Any, x: torch.Tensor, wrt: str, fn: bool = False) -> Callable[[], Any]:
    for _ in range(codegen.AFTER_CALLS + 2):  # the guard (second call), the profile, and its generated code
        jm.jacobian(net, x, wrt=wrt)
    opts = check_options(wrt=wrt, mode="auto", batched=True, structure="auto", chunk_size=None,
                         create_graph=False, flatten=True)
    prof = _jacobian_profile(net, wrt)
    problem, decision = prof.facts.problem, prof.facts.decision
    p = again(problem, net, x, opts)
    hit = prof.runs.get("probe_code")
    if hit is not None and not fn:  # the profile's generated code (_jacobian._direct): the engine of the call
        code, tensors = hit.code, [d[n] for d, n in hit.refs]

        def generated() -> Any:
            with torch.no_grad():
                return code(x, *tensors)

        return generated

    def engine() -> Any:
        with torch.no_grad():
            return execute(net, p, decision, opts, None) if fn else run(p, decision.plan, None)

    return engine


def _operator_engine(net: Any, x: torch.Tensor, name: str, *args: Any, fn: bool = False) -> Callable[[], Any]:
    opts = check_options(wrt="inputs", mode="forward", batched=True, structure="auto", chunk_size=None,
                         create_graph=False, flatten=True)
    with target(net, x, opts) as t:
        tt = t
    with torch.no_grad():
        for _ in range(codegen.AFTER_CALLS + 2):  # the guard, then generate the code of this signature
            tt.run(name, tt.z, *args)
    program = tt.program
    entries = [v for k, v in (program.__dict__.get("_codegen", {}) if program is not None else {}).items()
               if k[0] == name and callable(v)]
    if fn or len(entries) != 1:
        def engine() -> Any:
            with torch.no_grad():
                return tt.run(name, tt.z, *args)

        return engine
    code = entries[0]
    tensors = codegen._layout(program).read(program)[1]
    z = tt.z

    def generated() -> Any:
        with torch.no_grad():
            return code(z, *tensors)

    return generated


def _psg_engine(net: Any, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    selected = list(net.named_parameters())
    cov = layerio.usable(net, x, selected)
    assert cov is not None and not cov.uncovered
    n_params = sum(p.numel() for _, p in selected)

    def losses(out: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).sum(1)

    def engine() -> Any:
        flat = torch.empty(x.shape[0], n_params)
        with torch.no_grad():
            _products_engine.per_sample_grads_layers(net, cov, x, losses, selected, flat)
        return flat

    return engine


ENTRY_POINTS = ("jacobian params", "jacobian inputs", "partials", "laplacian", "per_sample_grads")


def _paired(cases: dict[str, Callable[[], Any]], name: str, n: int,
            engine_case: str = "engine alone") -> tuple[float, float]:
    """Median of (eager - engine) and (transform - engine) over calls run back to back (the
    difference of two calls made a few microseconds apart is robust to the load of the machine)."""
    eager, trans, engine = cases[f"{name}: eager"], cases[f"{name}: transform"], cases[f"{name}: {engine_case}"]
    de: list[int] = []
    dt: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock(); engine(); t1 = clock(); eager(); t2 = clock(); trans(); t3 = clock()  # noqa: E702
        de.append((t2 - t1) - (t1 - t0))
        dt.append((t3 - t2) - (t1 - t0))
    return statistics.median(de) / 1e3, statistics.median(dt) / 1e3


def _first(fn: Callable[[], Any]) -> float:
    jm.clear_cache()
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = MLP(784, 20, 10)
    x = torch.randn(2, 784)
    y = torch.randn(2, 10)
    pinn = PinnNet(2, 64, 2)
    xp = torch.randn(16, 2)
    dims = [(0,), (1, 1)]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).sum(1)

    jac_p = jm.transform(jm.jacobian, net, wrt="params")
    jac_i = jm.transform(jm.jacobian, net)
    parts = jm.transform(jm.partials, pinn, dims=dims)
    lap = jm.transform(jm.laplacian, pinn)
    psg = jm.transform(jm.per_sample_grads, net, loss=loss)
    cases: dict[str, Callable[[], Any]] = {
        "jacobian params: eager": lambda: jm.jacobian(net, x, wrt="params"),
        "jacobian params: transform": lambda: jac_p(x),
        "jacobian params: engine alone": _jacobian_engine(net, x, "params"),
        "jacobian params: hand rule": lambda: params_hand_rule(net, x),
        "jacobian inputs: eager": lambda: jm.jacobian(net, x),
        "jacobian inputs: transform": lambda: jac_i(x),
        "jacobian inputs: engine alone": _jacobian_engine(net, x, "inputs"),
        "partials: eager": lambda: jm.partials(pinn, xp, dims),
        "partials: transform": lambda: parts(xp),
        "partials: engine alone": _operator_engine(pinn, xp, "partials", dims),
        "laplacian: eager": lambda: jm.laplacian(pinn, xp),
        "laplacian: transform": lambda: lap(xp),
        "laplacian: engine alone": _operator_engine(pinn, xp, "laplacian", range(2)),
        "per_sample_grads: eager": lambda: jm.per_sample_grads(net, x, loss, y=y),
        "per_sample_grads: transform": lambda: psg(x, y),
        "per_sample_grads: engine alone": _psg_engine(net, x, y),
        "jacobian params: engine fn": _jacobian_engine(net, x, "params", fn=True),
        "jacobian inputs: engine fn": _jacobian_engine(net, x, "inputs", fn=True),
        "partials: engine fn": _operator_engine(pinn, xp, "partials", dims, fn=True),
        "laplacian: engine fn": _operator_engine(pinn, xp, "laplacian", range(2), fn=True),
        "per_sample_grads: engine fn": _psg_engine(net, x, y),
    }
    med, mins = shuffled_us(cases, args.rounds)
    fixed = {name: _paired(cases, name, args.rounds) for name in ENTRY_POINTS}
    fixed_fn = {name: _paired(cases, name, args.rounds, "engine fn") for name in ENTRY_POINTS}
    loop = shuffled_us({"loop": lambda: params_loop(net, x)}, max(20, args.rounds // 20))[0]["loop"]
    print(f"1 thread, medians of {args.rounds} calls per case (blocks of 10, shuffled rounds), microseconds;")
    print("fixed = median over back-to-back pairs of (call - engine alone)\n")
    print(f"{'entry point':18s} {'eager':>9s} {'transform':>10s} {'engine':>9s} {'fixed eager':>12s} "
          f"{'fixed transform':>16s} {'engine fn':>10s} {'fixed vs fn: eager':>19s} {'transform':>10s}")
    for name in ENTRY_POINTS:
        e, t, g = med[f"{name}: eager"], med[f"{name}: transform"], med[f"{name}: engine alone"]
        print(f"{name:18s} {e:9.1f} {t:10.1f} {g:9.1f} {fixed[name][0]:12.1f} {fixed[name][1]:16.1f} "
              f"{med[f'{name}: engine fn']:10.1f} {fixed_fn[name][0]:19.1f} {fixed_fn[name][1]:10.1f}")
    print("(target: fixed <= 50 us)")
    print("\nthe same from the fastest call of each case (min(call) - min(engine alone)): robust where other "
          "processes load the machine")
    for name in ENTRY_POINTS:
        g = mins[f"{name}: engine alone"]
        print(f"{name:18s} fixed eager {mins[f'{name}: eager'] - g:8.1f}   fixed transform "
              f"{mins[f'{name}: transform'] - g:8.1f}   (engine alone {g:8.1f})")
    hand = med["jacobian params: hand rule"]
    print(f"\nproblem 1, MLP(784, 20, 10), B = 2, jacobian(wrt='params'):")
    print(f"  hand-derived rule {hand:8.1f} us")
    print(f"  transform         {med['jacobian params: transform']:8.1f} us  {med['jacobian params: transform'] / hand:5.2f}x the hand rule (target <= 1.5x)")
    print(f"  eager             {med['jacobian params: eager']:8.1f} us  {med['jacobian params: eager'] / hand:5.2f}x the hand rule (target <= 2x)")
    print(f"  engine alone      {med['jacobian params: engine alone']:8.1f} us  {med['jacobian params: engine alone'] / hand:5.2f}x the hand rule")
    print(f"  users' loop       {loop:8.1f} us  eager is {loop / med['jacobian params: eager']:5.1f}x faster (target >= 10x)")

    first = {
        "jacobian params": lambda: jm.jacobian(net, x, wrt="params"),
        "jacobian inputs": lambda: jm.jacobian(net, x),
        "derivative": lambda: jm.derivative(torch.nn.Sequential(torch.nn.Linear(1, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4)),
                      xp[:, :1], order=2),
        "partials": lambda: jm.partials(pinn, xp, dims),
        "hessian": lambda: jm.hessian(pinn, xp),
        "laplacian": lambda: jm.laplacian(pinn, xp),
        "divergence": lambda: jm.divergence(lambda z: torch.tanh(z) * 2, xp),
        "biharmonic": lambda: jm.biharmonic(pinn, xp),
        "per_sample_grads": lambda: jm.per_sample_grads(net, x, loss, y=y),
        "ggn": lambda: jm.ggn(net, x, diagonal=True),
        "ntk": lambda: jm.ntk(net, x),
    }
    print("\nfirst call after jm.clear_cache() (one run each, profile + capture + checks), ms")
    for name, fn in first.items():
        print(f"  {name:18s} {_first(fn) / 1e3:8.2f}")


if __name__ == "__main__":
    main()
