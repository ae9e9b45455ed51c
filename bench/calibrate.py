"""Calibrate the cost and memory models on this machine: ``python -m bench.calibrate``.

Times ``jacobian(mode="forward")`` and ``mode="reverse"`` (interleaved, medians) over a grid of
MLPs and a small CNN -- wrt inputs and parameters, N/Y from 1/100 to 100/1, B from 1 to 1024 --
fits the constants of the cost model (see the note in ``_planning/plan.py``) by least squares on the
log of predicted over measured time with non-negative coefficients, measures the workspace multipliers of the memory
model from the peak resident memory of subprocesses, writes ``jacmode/_planning/calibrated.json``, and draws the
forward/reverse crossover plot (matplotlib). ``--regret`` checks ``mode="auto"`` against the
faster explicit mode on a second grid that was not used for fitting.

Commands:
    python -m bench.calibrate [--write] [--plot FILE.png] [--json FILE]
    python -m bench.calibrate --probes [--write] [--json FILE]   (the probe engine's constants alone)
    python -m bench.calibrate --every [--drawn 96] [--seed 1] [--write] [--json FILE] [--refit FILE]
        [--device cuda]  (every engine at once, also on drawn module classes: see ``grids``; on a GPU,
        its own constants file, which the planner reads for calls on that device type)
    python -m bench.calibrate --regret [--json FILE]
    python -m bench.calibrate --memory-check [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from typing import Any, Optional, Sequence

import torch

from .calibrate_memory import MARGIN, calibrate_memory, measure_workspace, memory_check  # noqa: F401
from .grid import Case, _axes, fit_grid, probe_grid, regret_grid  # noqa: F401
from .timing import placed, synced, use_device

FIT_TERMS = ("call", "pass_ops", "vmap_ops", "pass_flops", "pass_conv", "pass_bytes", "dir_flops", "dir_conv",
             "dir_bytes", "dir_spill", "result", "seed", "calls", "fresh", "bias", "conv_out", "pages", "special", "pass_conv_out",
             "conv_spill")


def time_modes(case: Case, modes: Sequence[str], reps: int = 7, budget_s: float = 2.0,
               warm: int = 1) -> dict[str, float]:
    """Median seconds per call of ``jacobian`` in each mode, the modes interleaved, after ``warm``
    calls of each (fewer where they pass 2 s: a repeated call of the probe engine runs generated
    code from its third call on, and is steady from about the sixth)."""
    import jacmode as jm

    model, x = placed(case.build())
    calls = {m: synced(functools.partial(jm.jacobian, model, x, wrt=case.wrt, mode=m), x) for m in modes}
    for call in calls.values():
        t0 = time.perf_counter()
        for _ in range(warm):
            call()
            if time.perf_counter() - t0 > 2.0:
                break
    times: dict[str, list[float]] = {m: [] for m in modes}
    start = time.perf_counter()
    for r in range(reps):
        for m in (modes if r % 2 == 0 else list(reversed(modes))):
            t0 = time.perf_counter()
            calls[m]()
            times[m].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {m: statistics.median(v) for m, v in times.items()}


def _call_kwargs(case: Any) -> dict[str, Any]:
    """The keywords of a case's ``jm.jacobian`` call: a grid's (wrt) or a drawn case's (wrt, batched)."""
    return case.kwargs() if hasattr(case, "kwargs") else {"wrt": case.wrt}


def terms(case: Any, mode: str) -> dict[str, float]:
    """The cost-model terms of a case in ``mode``, for the chunk sizes jacobian would use.

    The key "engine" names the calibrated engine that runs it (see ``_plan.engine``).
    """
    from jacmode._checks import check_options
    from jacmode._planning import plan as _plan
    from jacmode._planning.decide import decide
    from jacmode._problem import describe

    model, x = placed(case.build())
    kw = _call_kwargs(case)
    opts = check_options(wrt=kw["wrt"], mode=mode, batched=kw.get("batched", True), structure="auto",
                         chunk_size=None, create_graph=False, flatten=True)
    with torch.no_grad():
        p = describe(model, x, opts)
        d = decide(model, p, opts, out_given=False)
    q = d.plan
    name = _plan.engine(p, q.mode, q.strategy)
    out: dict[str, Any]
    if name == "reverse-probes":  # its own terms (see [One cost per engine] in _planning/engines.py)
        from jacmode._planning.engines import probe_terms

        out = probe_terms(p, d.fp, q.sample_chunk)
    else:
        out = _plan.features(p, d.fp, q.mode, q.strategy, q.directions, q.chunk_size, q.sample_chunk)
    out["engine"] = name  # type: ignore[assignment]
    return out


def grids(drawn: int = 96, seed: int = 1) -> dict[str, list[Any]]:
    """The grids ``--every`` fits on: the fit grid (MLPs, elementwise nets, a CNN; both modes), the
    probe grid (the probe engine) and ``drawn`` cases of ``bench.regret``'s draw with ``seed`` (module
    classes with norms, residuals, conv fronts, parameter subsets, unbatched points). The regret
    benchmark draws with seed 0: its cases are not fitted on."""
    from .regret import draw

    return {"fit": fit_grid(), "probe": probe_grid(), f"drawn:{seed}": draw(drawn, seed)}


def _grid(name: str, size: int) -> list[Any]:
    """The cases of the grid ``name`` (of ``grids``), ``size`` of them for a drawn one."""
    if name.startswith("drawn:"):
        from .regret import draw

        return draw(size, int(name.split(":")[1]))
    return {"fit": fit_grid, "probe": probe_grid}[name]()


def calibrate_every(drawn: int = 96, seed: int = 1, log: Any = print) -> tuple[dict[str, dict[str, float]], list[dict]]:
    """Time every engine on the three grids (``grids``) and fit each engine's constants on every
    record it ran. A record is one (case, mode): its engine, median seconds and terms. A mode the
    cost model prices 100x slower than the other on a drawn case is not timed (``regret.HOPELESS``)."""
    import jacmode as jm

    from . import regret

    records: list[dict[str, Any]] = []
    for name, cases in grids(drawn, seed).items():
        for i, case in enumerate(cases):
            modes: tuple[str, ...] = ("reverse",) if name == "probe" else ("forward", "reverse")
            if name.startswith("drawn"):
                model, x = placed(case.build())
                costs = jm.plan(model, x, **_call_kwargs(case)).costs
                modes = tuple(m for m in modes if costs.get(m, math.inf) <= regret.HOPELESS * min(costs.values()))
            if name.startswith("drawn"):
                t = regret.time_modes(case, modes)
            else:
                t = time_modes(case, modes, reps=7, warm=6)
            for m, sec in t.items():
                tm = terms(case, m)
                records.append({"grid": name, "index": i, "size": len(cases), "case": case.label, "mode": m,
                                "engine": tm["engine"], "seconds": sec, "terms": tm})
            shown = ", ".join(f"{m} {sec * 1e3:.3g} ms" for m, sec in t.items())
            log(f"[{name} {i + 1}/{len(cases)}] {case.label}: {shown}")
    return fit_records(records), records


def fit_records(records: list[dict]) -> dict[str, dict[str, float]]:
    """One set of constants per engine, each fitted on the records that engine ran."""
    by_engine: dict[str, tuple[list, list]] = {}
    for r in records:
        rows, secs = by_engine.setdefault(r["engine"], ([], []))
        rows.append(r["terms"])
        secs.append(r["seconds"])
    fitted = {e: nnls_relative(rows, secs) for e, (rows, secs) in sorted(by_engine.items())}
    # the generic engines keep the terms of their cost model (plan.py); the probe engine all of them
    return {e: c if e == "reverse-probes" else {k: v for k, v in c.items() if any(k in r for r in by_engine[e][0])}
            for e, c in fitted.items()}


def refit_every(records: list[dict]) -> dict[str, dict[str, float]]:
    """Fit again on the timings of an earlier ``--every --json`` run, the terms recomputed by the
    current cost model (the cases rebuilt from their grid and index)."""
    built: dict[str, list[Any]] = {}
    for r in records:
        cases = built.setdefault(r["grid"], _grid(r["grid"], r["size"]))
        r["terms"] = terms(cases[r["index"]], r["mode"])
        r["engine"] = r["terms"]["engine"]
    return fit_records(records)


def calibrate_probes(cases: list[Case], log: Any = print) -> tuple[dict[str, float], list[dict]]:
    """Time the probe engine (mode="reverse", repeated calls: its generated code) on the probe grid
    and fit its constants; two sweeps, the quieter median kept."""
    records: list[dict[str, Any]] = []
    for sweep in (1, 2):
        for i, case in enumerate(cases):
            t = time_modes(case, ("reverse",), reps=7, warm=6)["reverse"]
            if sweep == 1:
                tm = terms(case, "reverse")
                records.append({"case": case.label, "seconds": t, "terms": tm, "b": case.b})
            else:
                records[i]["seconds"] = min(t, records[i]["seconds"])
            log(f"[sweep {sweep}: {i + 1}/{len(cases)}] {case.label}: {records[i]['seconds'] * 1e3:.3g} ms "
                f"({records[i]['terms']['engine']})")
    mine = [r for r in records if r["terms"]["engine"] == "reverse-probes"]
    fitted = nnls_relative([r["terms"] for r in mine], [r["seconds"] for r in mine])
    return fitted, records


def refit(records: list[dict]) -> dict[str, dict[str, float]]:
    """Fit again on recorded timings, with the terms recomputed by the current cost model."""
    cases = {c.label: c for c in fit_grid()}
    for rec in records:
        rec["terms"] = {m: terms(cases[rec["case"]], m) for m in ("forward", "reverse")}
    return fit_engines(records)


def nnls_relative(rows: list[dict[str, float]], seconds: list[float], rounds: int = 30) -> dict[str, float]:
    """Non-negative constants that fit the seconds by their ratio: least squares on the log of
    predicted over measured, the error that "within 2x" counts.

    Least squares on relative errors ((predicted - measured) / measured, Lawson and Hanson's active
    set) starts it; it penalises a 3x over-prediction (error 2) far more than a 3x
    under-prediction (0.67), so alone it fits low. Each round then weighs every row by
    1 / sqrt(predicted * measured), a Gauss-Newton step on the log-ratio, and solves again.
    """
    import numpy as np

    A = np.array([[r.get(t, 0.0) for t in FIT_TERMS] for r in rows])
    return {t: float(c) for t, c in zip(FIT_TERMS, nnls_log(A, np.array(seconds), rounds))}


def nnls_log(A: Any, b: Any, rounds: int = 30) -> Any:
    """:func:`nnls_relative` on a matrix: the non-negative x with A x closest to b by the log-ratio."""
    import numpy as np

    w = 1.0 / b
    for _ in range(1 + rounds):
        Aw = A * w[:, None]
        scale = np.maximum(Aw.max(axis=0), 1e-30)
        coef = _nnls(Aw / scale, b * w) / scale
        w = 1.0 / np.sqrt(np.maximum(A @ coef, 1e-3 * b) * b)
    return coef


def _nnls(A: Any, b: Any, tol: float = 1e-10) -> Any:
    """argmin ||A x - b|| over x >= 0 (Lawson and Hanson, 1974): add the variable of the largest
    gradient to the free set, solve on it, and step back to the boundary while a free one is negative."""
    import numpy as np

    n = A.shape[1]
    x, free = np.zeros(n), []  # type: ignore[var-annotated]
    for _ in range(3 * n):
        w = A.T @ (b - A @ x)
        rest = [j for j in range(n) if j not in free and A[:, j].any()]
        if not rest or max(w[rest]) <= tol:
            break
        free.append(rest[int(np.argmax(w[rest]))])
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            neg = [k for k in free if z[k] <= 0]
            alpha = min(x[k] / (x[k] - z[k]) for k in neg)
            x = x + alpha * (z - x)
            free = [k for k in free if x[k] > tol]
    return x


def calibrate_costs(cases: list[Case], log: Any = print) -> tuple[dict[str, dict[str, float]], list[dict]]:
    """Time the fit grid and fit the constants of each mode."""
    records: list[dict[str, Any]] = []
    for i, case in enumerate(cases):
        t = time_modes(case, ("forward", "reverse"), reps=9)
        rec: dict[str, Any] = {"case": case.label, "seconds": t, "terms": {m: terms(case, m) for m in t}, "axes": _axes(case),
               "b": case.b, "family": case.family, "kind": "inputs" if case.wrt == "inputs" else "params"}
        records.append(rec)
        log(f"[{i + 1}/{len(cases)}] {case.label}: forward {t['forward'] * 1e3:.3g} ms, reverse {t['reverse'] * 1e3:.3g} ms")
    for i, (case, rec) in enumerate(zip(cases, records)):  # a second sweep, later: keep the quieter median
        t = time_modes(case, ("forward", "reverse"), reps=9)
        rec["seconds"] = {m: min(t[m], rec["seconds"][m]) for m in t}
        log(f"[sweep 2: {i + 1}/{len(cases)}] {case.label}: forward {rec['seconds']['forward'] * 1e3:.3g} ms, "
            f"reverse {rec['seconds']['reverse'] * 1e3:.3g} ms")
    return fit_engines(records), records


def fit_engines(records: list[dict]) -> dict[str, dict[str, float]]:
    """:func:`fit_records` on the records of :func:`calibrate_costs` (both modes in one record)."""
    return fit_records([{"engine": r["terms"][m].get("engine", m), "terms": r["terms"][m], "seconds": r["seconds"][m]}
                        for r in records for m in ("forward", "reverse")])


def write_data(updates: dict[str, Any], path: Optional[str] = None) -> str:
    """Replace the names in ``updates`` in the package's ``_planning/calibrated.json``; return its path.

    The other names are kept as they are (the NTK calibrator and this one share the file). The library
    reads the file once at import (``jacmode._planning.calibrated``): a new process sees the new constants.
    """
    from jacmode._planning import calibrated as _calibrated

    target = path or str(_calibrated.path())
    data = _calibrated.load(target if path else _calibrated.DATA_FILE)
    data.update(updates)
    with open(target, "w") as fh:
        fh.write(json.dumps(data, indent=1) + "\n")
    return target


def write_constants(costs: dict[str, dict[str, float]], memory: dict[str, float], path: Optional[str] = None) -> str:
    """Write the cost and memory constants (4 significant digits) and the machine to ``calibrated.json``."""
    import os
    import platform

    machine = f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}"
    cost = {m: {k: float(f"{v:.4g}") for k, v in c.items()} for m, c in costs.items()}
    return write_data({"MACHINE": machine, "COST": cost, "MEMORY": dict(memory)}, path)


def write_device_constants(costs: dict[str, dict[str, float]], device_type: str, path: Optional[str] = None) -> str:
    """Write a device type's cost constants (4 significant digits) and machine to its own file
    (``calibrated-<device type>.json``, see ``jacmode._planning.calibrated.cost``); return its path."""
    from jacmode._planning import calibrated as _calibrated

    target = path or str(_calibrated.device_path(device_type))
    name = torch.cuda.get_device_name() if device_type == "cuda" and torch.cuda.is_available() else device_type
    cost = {m: {k: float(f"{v:.4g}") for k, v in c.items()} for m, c in costs.items()}
    with open(target, "w") as fh:
        fh.write(json.dumps({"MACHINE": f"{name}, torch {torch.__version__}", "COST": cost}, indent=1) + "\n")
    return target


def plot_crossover(records: list[dict], costs: dict[str, dict[str, float]], path: str) -> None:
    """forward/reverse time ratio against N/Y, measured (points) and modelled (crosses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kind in zip(axes, ("inputs", "params")):
        for b, colour in zip((1, 16, 128, 1024), ("C0", "C1", "C2", "C3")):
            rs = [r for r in records if r["kind"] == kind and r["b"] == b]
            if not rs:
                continue
            ratio = [r["axes"][0] / r["axes"][1] for r in rs]
            measured = [r["seconds"]["forward"] / r["seconds"]["reverse"] for r in rs]
            model = [_est(costs, r, "forward") / _est(costs, r, "reverse") for r in rs]
            ax.scatter(ratio, measured, color=colour, label=f"B={b} measured", s=22)
            ax.scatter(ratio, model, color=colour, marker="x", s=22, alpha=0.6)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N / Y (input directions / output directions)")
        ax.set_title(f"wrt={kind!r}: forward time / reverse time")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("t_forward / t_reverse  (< 1: forward wins)")
    axes[0].legend(fontsize=8, title="dots measured, x cost model", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _est(costs: dict[str, dict[str, float]], rec: dict, mode: str) -> float:
    t = rec["terms"][mode]
    return sum(costs[t.get("engine", mode)].get(k, 0.0) * v for k, v in t.items() if k != "engine")


def regret(cases: list[Case], log: Any = print, recheck: float = 1.15) -> list[dict]:
    """Time auto, forward and reverse on each case; re-run doubtful points once, longer."""
    import jacmode as jm

    out: list[dict[str, Any]] = []
    for i, case in enumerate(cases):
        t = time_modes(case, ("auto", "forward", "reverse"))
        r = t["auto"] / min(t["forward"], t["reverse"])
        if r > recheck:  # a noisy machine: look again before believing it
            t = time_modes(case, ("auto", "forward", "reverse"), reps=15, budget_s=6.0)
            r = t["auto"] / min(t["forward"], t["reverse"])
        model, x = placed(case.build())
        chosen = jm.plan(model, x, wrt=case.wrt).mode
        out.append({"case": case.label, "seconds": t, "regret": r, "auto_mode": chosen, "axes": _axes(case)})
        log(f"[{i + 1}/{len(cases)}] {case.label}: auto={chosen} {t['auto'] * 1e3:.3g} ms, forward "
            f"{t['forward'] * 1e3:.3g}, reverse {t['reverse'] * 1e3:.3g} -> regret {r:.3f}")
    rs: list[float] = sorted(x["regret"] for x in out)
    log(f"{len(rs)} cases: median regret {statistics.median(rs):.3f}, 90th percentile "
        f"{rs[math.ceil(0.9 * len(rs)) - 1]:.3f}, max {rs[-1]:.3f}, within 1.15x: "
        f"{sum(r <= 1.15 for r in rs)}/{len(rs)}, above 2x: {sum(r > 2 for r in rs)}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--regret", action="store_true", help="judge mode='auto' on the regret grid")
    parser.add_argument("--probes", action="store_true",
                        help="fit the probe engine's constants alone (COST['reverse-probes']) on the probe grid")
    parser.add_argument("--every", action="store_true",
                        help="fit every engine's constants on the fit grid, the probe grid and drawn cases")
    parser.add_argument("--drawn", type=int, default=96, help="with --every: how many drawn cases")
    parser.add_argument("--seed", type=int, default=1, help="with --every: the draw's seed (the regret uses 0)")
    parser.add_argument("--memory-check", action="store_true",
                        help="peak memory of a large parameter Jacobian under max_memory='200MB'")
    parser.add_argument("--write", action="store_true", help="write the fitted constants to jacmode/_planning/calibrated.json")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory multipliers")
    parser.add_argument("--refit", metavar="FIT.json",
                        help="fit again on the timings of an earlier --json run (terms recomputed)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the crossover plot")
    parser.add_argument("--json", metavar="FILE", help="save the measurements")
    parser.add_argument("--device", default="cpu",
                        help="with --every: build and time every case on this device (e.g. cuda); --write then writes "
                             "that device type's constants file (calibrated-cuda.json) and leaves the CPU's alone")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: on a shared machine, OpenMP kernels with more "
                             "threads than free cores stall for tens of milliseconds)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_check:
        records = [memory_check()]
    elif args.every:
        from jacmode._planning import calibrated as _calibrated

        use_device(args.device)  # the cases' models and inputs are moved there
        if args.refit:
            with open(args.refit) as fh:
                records = json.load(fh)
            costs = refit_every(records)
        else:
            costs, records = calibrate_every(args.drawn, args.seed)
        from jacmode._planning.engines import WHAT

        # an engine no record ran keeps its constants; an engine that no longer exists goes
        costs = {e: costs.get(e, _calibrated.COST.get(e, {})) for e in WHAT if e in costs or e in _calibrated.COST}
        print(json.dumps(costs, indent=1))
        if args.write and torch.device(args.device).type != "cpu":
            print("wrote", write_device_constants(costs, torch.device(args.device).type))
        elif args.write:
            print("wrote", write_constants(costs, dict(_calibrated.MEMORY)))
    elif args.probes:
        from jacmode._planning import calibrated as _calibrated

        if args.refit:  # the timings of an earlier --probes --json run, the terms recomputed
            with open(args.refit) as fh:
                records = json.load(fh)
            cases = {c.label: c for c in probe_grid()}
            for rec in records:
                rec["terms"] = terms(cases[rec["case"]], "reverse")
            mine = [r for r in records if r["terms"]["engine"] == "reverse-probes"]
            fitted = nnls_relative([r["terms"] for r in mine], [r["seconds"] for r in mine])
        else:
            fitted, records = calibrate_probes(probe_grid())
        print(json.dumps(fitted, indent=1))
        if args.write:
            costs = {**_calibrated.COST, "reverse-probes": fitted}
            cost = {m: {k: float(f"{v:.4g}") for k, v in c.items()} for m, c in costs.items()}
            print("wrote", write_data({"COST": cost}))
    elif args.regret:
        records = regret(regret_grid())
    else:
        if args.refit:
            with open(args.refit) as fh:
                records = json.load(fh)
            costs = refit(records)
        else:
            costs, records = calibrate_costs(fit_grid())
        from jacmode._planning import calibrated as _calibrated

        memory = dict(_calibrated.MEMORY) if args.no_memory else calibrate_memory()
        print(json.dumps({"COST": costs, "MEMORY": memory}, indent=1))
        if args.write:
            print("wrote", write_constants(costs, memory))
        if args.plot:
            plot_crossover(records, costs, args.plot)
            print("plot:", args.plot)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
