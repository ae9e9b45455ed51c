"""Decide how a call runs: footprint, capabilities, memory budget, cost model or autotuning.

``decide`` is what :func:`jacmode.plan` returns and what :func:`jacmode.jacobian` runs, so the
two never disagree; ``execute`` runs a plan and, under ``mode="auto"``, re-plans around an engine
gap that the capability probe could not foresee (see the note in ``_autodiff/fallback.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from .._args import take
from .._cache import problem_key, rng_kept, warn_once
from .._checks import Options
from .._autodiff import fallback as _fallback
from .._autodiff import loops as _loops
from .._autodiff.fallback import Caps
from .._problem import Problem, own_input
from .._structure import run
from . import autotune as _autotune
from . import footprint as _footprint
from . import memory as _memory
from .footprint import Footprint
from .engines import strategies
from .plan import MODES, Plan, make_plan, minimum_workspace


@dataclass
class Decision:
    """A plan and what it was made from (needed to re-plan after a fallback)."""

    plan: Plan
    key: tuple
    fp: Footprint
    caps: Caps
    budget: float


def _measure(f: Any, key: tuple, p: Problem) -> Footprint:
    if p.batch == 0:
        return Footprint(ops=0, flops=0.0, act=0.0, peak=0.0)
    # one sample (the coupling probe already ran f on a few), more if f couples them; always a
    # copy, since f may modify its input in place
    k = (min(p.batch, 4) if p.structure == "coupled" else 1) if p.batched else 1
    x = (p.x[:k] if p.batched else p.x).detach().clone()
    g = take(f, slice(0, k)) if p.batched else f  # a call of several arguments: riders of those samples
    hooked = list(p.probes.modules) if p.probes is not None else []  # the probe engine's tail
    with rng_kept(p.device):
        try:
            return _footprint.footprint(f, key, g, x, k, hooked)
        except Exception:  # noqa: BLE001 - f may need more samples (e.g. batch statistics)
            if not p.batched or k == p.batch:
                raise
            return _footprint.footprint(f, key, f, p.x.detach().clone(), p.batch, hooked)


def decide(f: Any, p: Problem, opts: Options, out_given: bool, timing: bool = True) -> Decision:
    """The plan for a call (raises before computing when the call cannot run or fit).

    ``timing=False`` (for :func:`jacmode.plan`) takes autotuned modes from the cache only.
    """
    key = problem_key(f, p.x, p.batched, opts.param_names or opts.wrt, p.structure, full_shape=False)
    fp = _measure(f, key, p)
    caps = _fallback.capabilities(f, key, p)
    itemsize = p.z.element_size()
    result_bytes = itemsize * (p.n_in if p.structure == "diagonal" else p.batch * p.n_out * p.n_in)
    budget = _memory.budget(opts.max_memory, p.device, result_bytes, out_given)
    if budget is None:
        raise _memory.too_large(result_bytes, p.device, "the result", f"{_shape(p)} {p.dtype}",
                                "Ask for fewer samples per call (split x), a parameter subset (wrt=[...]), "
                                "or pass a preallocated out= (e.g. a memory-mapped tensor).")
    return Decision(_plan(f, key, p, opts, fp, caps, budget, timing), key, fp, caps, budget)


def _shape(p: Problem) -> str:
    return f"({p.batch}, {p.n_out}, {p.n_in})" if p.batched else f"({p.n_out}, {p.n_in})"


def _plan(f: Any, key: tuple, p: Problem, opts: Options, fp: Footprint, caps: Caps, budget: float,
          timing: bool = True) -> Plan:
    mode = opts.mode
    per_sample = strategies(p)["reverse"][0] == "per-sample"
    if mode in MODES:  # explicit: raise rather than fall back
        if caps.functorch:
            raise _fallback.explicit_error(mode, "functorch", caps.functorch)
        if mode == "forward" and caps.forward:
            raise _fallback.explicit_error(mode, "forward", caps.forward)
        if mode == "reverse" and per_sample and caps.vmap_samples:
            raise _fallback.explicit_error(mode, "vmap", caps.vmap_samples)
    allowed: tuple[str, ...] = MODES
    loops: dict[str, str] = {}
    why = ""
    if caps.functorch:
        allowed, loops = ("reverse",), {"reverse": "autograd"}
        why = f"fell back to torch.autograd.grad loops: torch.func cannot run {caps.functorch}"
    else:
        if caps.forward:
            allowed = ("reverse",)
            why = f"forward mode is unavailable: no forward-AD formula for {caps.forward}"
        if per_sample and caps.vmap_samples:
            loops = {"reverse": "samples"}
            why += ("; " if why else "") + f"reverse mode loops over samples: vmap cannot batch {caps.vmap_samples}"
    chunk_size = opts.chunk_size
    if caps.vmap_directions:
        chunk_size = 1
        why += ("; " if why else "") + f"one direction per pass: vmap cannot batch {caps.vmap_directions}"
    auto = mode in ("auto", "autotune")
    plan = make_plan(p, fp, "auto" if auto else mode, chunk_size, budget, allowed=allowed,
                     loops=loops, why=why)
    if plan is None:
        need = min(minimum_workspace(p, fp, m) for m in (allowed if auto else (mode,)))
        raise ValueError(
            f"max_memory: even one direction per pass needs about {_memory.fmt_bytes(need)} of "
            f"workspace, over the budget of {_memory.fmt_bytes(budget)}"
            f"{'' if opts.max_memory else ' (half of the free memory)'}. Raise max_memory, or use "
            "fewer samples per call."
        )
    slower = plan.loop or caps.vmap_directions or (caps.forward and _would_pick_forward(p, fp, opts, budget))
    if why and auto and slower:
        warn_once(f, f"jacmode: {why}. The result is exact, only slower.")
    if mode == "autotune" and plan.loop is None and len(allowed) > 1:
        plan = _autotune.tuned(f, key, p, opts, plan, lambda m: make_plan(
            p, fp, m, chunk_size, budget, allowed=allowed, loops=loops, why=why), timing)
    return plan


def _would_pick_forward(p: Problem, fp: Footprint, opts: Options, budget: float) -> bool:
    plan = make_plan(p, fp, "auto", opts.chunk_size, budget)
    return plan is not None and plan.mode == "forward"


def _no_vmap(p: Problem, plan: Plan) -> bool:
    """Whether the engine of ``plan`` on ``p`` runs without vmap (see :func:`execute`)."""
    if plan.strategy == "per-sample":
        return p.probes is not None and not p.probes.uncovered
    return plan.strategy == "broadcast" and plan.mode == "forward" and p.program is not None


def execute(f: Any, p: Problem, d: Decision, opts: Options, out: Optional[Tensor]) -> Tensor:
    """Run the plan; under ``mode="auto"`` re-plan around gaps found while running (at most twice)."""
    for _ in range(3):
        plan = d.plan
        try:
            # the probe engine (every parameter covered) and forward mode over a captured program
            # (Taylor mode, ``_structure.run``: its fallback to vmap translates its own warnings)
            # run no vmap, so no vmap warning to translate: no warnings context, which a repeated
            # small call would feel
            with (contextlib.nullcontext() if plan.loop is None and _no_vmap(p, plan)
                  else _fallback.translated_warnings()):
                if plan.loop == "autograd":
                    safe = _fallback.params_fn(f, p, p.x.detach().clone()) if p.kind == "params" else p.fn
                    return _loops.autograd_rows(p, plan, out, opts.create_graph, safe)
                if plan.loop == "samples":
                    return _loops.sample_loop(p, plan, out)
                return run(p, plan, out)
        except (RuntimeError, NotImplementedError) as exc:
            gap = _fallback.classify(exc)
            if gap is None:
                raise
            if opts.mode in MODES:
                raise _fallback.explicit_error(plan.mode, *gap) from exc
            _fallback.learn(f, d.key, d.caps, plan, *gap)
            d.plan = _plan(f, d.key, p, opts, d.fp, d.caps, d.budget)
            own_input(p)  # the next engine may run f: never on x itself
    raise RuntimeError("jacmode: no engine could run f")  # pragma: no cover

