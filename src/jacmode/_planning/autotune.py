"""``mode="autotune"``: time the candidates once on the actual inputs and cache the winner.

NOTE: [Autotuning]
Each candidate plan (forward and reverse, chunked for the memory budget) is timed on the call's
own inputs. A candidate the cost model expects to finish within ``WHOLE_S`` is run whole (one
warm-up, then the best of up to three runs); a longer one is timed on truncated passes sized to a
few milliseconds (``PASS_S``) -- k and k/2 directions, or a subset of samples for per-sample
Jacobians -- and the full time is extrapolated from the per-pass and per-direction parts. The
candidates timed are the best by the cost model and every other predicted within ``MODEL_ERROR`` of
it (the spread of the model's predicted/measured ratio on the regret grid, docs/modes.md): one
predicted further off is not timed, the model being sure enough. Per-sample parameter Jacobians
are timed on the engine that runs them (the probe engine where it serves). The
winner is cached per function (weakly), input shape, dtype, device, wrt, structure, chunk size and
memory budget, and reused without timing; :func:`autotune_cache` lists the entries and
:func:`jacmode.clear_cache` forgets them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .._cache import Kind, rng_kept
from .._checks import Options
from .._autodiff.forward import forward_columns, layerwise_columns
from .._autodiff.reverse import per_sample_rows, reverse_rows
from .._problem import Problem
from .._probes import layerwise
from .._structure import _SEEDS, run
from .plan import MODES, Plan, with_reason

WHOLE_S = 0.05
PASS_S = 0.005
MODEL_ERROR = 4.0  # predicted times further apart than this are not timed (see the note)


@dataclass(frozen=True)
class Tuned:
    """A cached autotuning verdict: the winning mode and the seconds measured for each mode."""

    mode: str
    seconds: dict[str, float]
    how: str


_WINNERS = Kind("autotune")


def tuned(f: Any, key: tuple, p: Problem, opts: Options, plan: Plan,
          plan_for: Callable[[str], Optional[Plan]], timing: bool = True) -> Plan:
    """The plan of the fastest candidate, timed now (if ``timing``) or taken from the cache."""
    tkey = key + (p.batch, opts.chunk_size, opts.max_memory, opts.create_graph)
    hit = _WINNERS.get(f, tkey)
    if hit is None and not timing:
        return with_reason(plan, f"{plan.reason}; not timed yet: jacobian(mode='autotune') times "
                                 "the candidates on its first call and caches the winner")
    if hit is None:
        plans = {m: q for m in MODES if (q := plan_for(m)) is not None}
        best = min(q.costs.get(m, math.inf) for m, q in plans.items())
        close = {m: q for m, q in plans.items() if q.costs.get(m, math.inf) <= MODEL_ERROR * best}
        seconds, hows = {}, set()
        with rng_kept(p.device):
            for m, q in close.items():
                seconds[m], how = _time(p, q)
                hows.add(how)
        far = [m for m in plans if m not in close]
        if far:
            hows.add(f"{' and '.join(far)} not timed: predicted over {MODEL_ERROR:g}x slower than the best")
        hit = Tuned(min(seconds, key=lambda m: seconds[m]), seconds, "; ".join(sorted(hows)))
        _WINNERS.put(f, tkey, hit)
    chosen = plan_for(hit.mode) or plan
    times = ", ".join(f"{m} {s * 1e3:.3g} ms" for m, s in hit.seconds.items())
    model = ", ".join(f"{m} {s * 1e3:.3g} ms" for m, s in plan.costs.items())
    return with_reason(chosen, f"autotuned on these inputs ({hit.how}): {times}; the cost model "
                               f"estimated {model} and picks {plan.mode}", costs=dict(hit.seconds))


def _best(call: Callable[[], Any], repeats: int, device: torch.device) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _time(p: Problem, plan: Plan) -> tuple[float, str]:
    """Seconds that ``plan`` takes on ``p``, measured whole or extrapolated."""
    predicted = plan.costs.get(plan.mode, math.inf)
    if predicted <= WHOLE_S:
        run(p, plan)  # warm-up
        return _best(lambda: run(p, plan), 3 if predicted < WHOLE_S / 3 else 1, p.device), "whole runs"
    share = min(1.0, PASS_S / predicted)
    if plan.strategy == "per-sample" and p.probes is not None and not p.probes.uncovered:
        s = max(1, min(p.batch, int(p.batch * share)))  # the probe engine, as run() runs it, on s samples
        named = [(n, t) for (n, _), t in zip(p.params, p.tensors)]
        part = torch.empty(s, p.n_out, p.n_in, dtype=p.dtype, device=p.device)
        call = lambda: layerwise.fill(p.model, p.x[:s], named, p.probes, part)  # type: ignore[arg-type]  # noqa: E731
        call()
        return _best(call, 2, p.device) * p.batch / s, f"extrapolated from {s} of {p.batch} samples"
    if plan.strategy == "per-sample":
        s = max(1, min(p.batch, int(p.batch * share)))
        noop5 = lambda *a: None  # noqa: E731
        call = lambda: per_sample_rows(p.sample_fn, p.z, p.x[:s], p.n_out, noop5,  # type: ignore[arg-type]
                                       s, plan.chunk_size)
        call()
        return _best(call, 2, p.device) * p.batch / s, f"extrapolated from {s} of {p.batch} samples"
    n, chunk = plan.directions, plan.chunk_size
    k = max(1, min(chunk, int(n * share)))
    engine = forward_columns if plan.mode == "forward" else reverse_rows
    seeds, _ = _SEEDS[(plan.strategy, plan.mode == "forward", p.kind == "params")](p, None, n)  # type: ignore[arg-type]
    noop = lambda s, e, blk: None  # noqa: E731
    program = p.program if plan.mode == "forward" and plan.strategy == "broadcast" else None

    def one_pass(width: int) -> float:
        if program is not None:  # the engine run() uses for this plan (see _structure.run)
            call = lambda: layerwise_columns(program, p.in_shape, p.z, width, noop, width)  # noqa: E731
        else:
            call = lambda: engine(p.fn, p.z, width, seeds, noop, width)  # noqa: E731
        call()
        return _best(call, 2, p.device)

    t_k = one_pass(k)
    if k < 2:
        return t_k * n, "extrapolated from 1 direction"
    h = k // 2
    t_h = one_pass(h)
    per_dir = max(0.0, (t_k - t_h) / (k - h))
    per_pass = max(0.0, t_k - per_dir * k)
    passes = math.ceil(n / chunk) if plan.mode == "forward" else 1
    return passes * per_pass + per_dir * n, f"extrapolated from passes of {h} and {k} directions"


def autotune_cache() -> list[dict[str, Any]]:
    """What ``mode="autotune"`` has measured and cached, one dict per entry.

    Each entry names the function and the key its verdict is cached under (input shape, dtype,
    device, wrt, structure, chunk size, memory budget), the winning mode and the seconds measured
    for each candidate. :func:`jacmode.clear_cache` empties it.

    Example:
        >>> import torch, jacmode as jm
        >>> jm.clear_cache()
        >>> net = torch.nn.Linear(3, 2)
        >>> x = torch.randn(8, 3)
        >>> _ = jm.jacobian(net, x, mode="autotune")  # a first call caches nothing (times, but keeps no winner)
        >>> jm.autotune_cache()
        []
        >>> _ = jm.jacobian(net, x, mode="autotune")  # the second call caches the winner
        >>> [(e["function"], e["shape"], e["mode"] in ("forward", "reverse")) for e in jm.autotune_cache()]
        [('Linear', (8, 3), True)]
    """
    entries = []
    for ident, key, tuned_ in _WINNERS.items():
        # the cache's key starts with the generation of f's state (and a flat call's structure):
        # _cache._resolved; autotune's own key is the last twelve elements
        *_scope, shape, dtype, device, batched, wrt, structure, _flags, _inference, batch, chunk, budget, graph = key
        entries.append({
            "function": getattr(ident, "__name__", type(ident).__name__),
            "shape": (batch, *shape) if batched else shape,
            "dtype": dtype, "device": device, "wrt": wrt, "structure": structure,
            "chunk_size": chunk, "max_memory": budget, "create_graph": graph,
            "mode": tuned_.mode, "seconds": dict(tuned_.seconds), "how": tuned_.how,
        })
    return entries
