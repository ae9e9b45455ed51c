"""Repeated calls: the problem and the plan of an identical earlier call, reused.

NOTE: [Repeated calls]
A training loop asks for the same parameter Jacobian again and again: same model, same flags, same
input shape, new values. Describing the problem (coupling probe, parameter selection, probe
coverage) and deciding its plan (footprint, capabilities, cost model) then find what they found
last time, at a fixed cost that dominates a small call (B = 2). The facts are therefore kept per
model (weakly) and per :func:`signature`: the input's shape, dtype and device, the options, and
what the call's one walk of the module tree (``_state.ModelView``) saw: every module's training
flag, the parameter objects, their ``requires_grad`` flags and dtypes, whether a ``torch.func``
transform is active, and whether inference mode is. Anything else changes the signature and takes
the full path. A hit rebuilds the problem's values at the new ``x`` (``_problem.again``) and re-checks the memory: the free
memory is re-read, the result must fit as in ``decide``, and the plan is reused only while its
workspace fits the new budget. ``jm.clear_cache()`` forgets these entries with the others.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ._cache import WeakCache
from ._checks import Options
from ._planning import memory as _memory
from ._planning.decide import Decision
from ._problem import Problem, again, facts
from ._state import ModelView
from ._functional import identities
from ._transforms import in_transform

_CALLS = WeakCache("repeated calls")


def signature(x: Tensor, opts: Options, view: Optional[ModelView], out_given: bool) -> Optional[tuple]:
    """What a call's problem and plan depend on, or None when it is not cached (see the note)."""
    if view is None or opts.wrt != "params" or opts.mode == "autotune":
        return None
    return (x.shape, x.dtype, x.device, opts, out_given, view.training, identities(view.modules[0], view.params),
            view.flags, tuple(p.dtype for p in view.params), in_transform(), torch.is_inference_mode_enabled())


def lookup(f: Any, x: Tensor, opts: Options, sig: Optional[tuple]) -> Optional[tuple[Problem, Decision]]:
    """The problem at ``x`` and the decision of an identical earlier call, or None."""
    if sig is None:
        return None
    hit = _CALLS.get(f, sig)
    if hit is None:
        return None
    problem, decision = hit
    p = again(problem, f, x, opts)
    result_bytes = p.z.element_size() * p.batch * p.n_out * p.n_in
    free = _memory.available_bytes(p.device)
    out_given = sig[4]
    if not out_given and result_bytes > free:
        return None  # decide raises the MemoryError
    budget = opts.max_memory if opts.max_memory is not None else max(
        0, int(_memory.DEFAULT_FRACTION * free) - (0 if out_given else result_bytes))
    if decision.plan.workspace_bytes > budget:
        return None
    decision.budget = budget
    return p, decision


def store(f: Any, sig: Optional[tuple], problem: Problem, decision: Decision) -> None:
    """Keep the problem's facts and the decision for later identical calls."""
    if sig is not None and problem.kind == "params":
        _CALLS.put(f, sig, (facts(problem), decision))
