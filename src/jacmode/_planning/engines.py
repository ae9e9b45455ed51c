"""The engines that compute a Jacobian, the cost each states for a problem, and which can serve it.

NOTE: [One cost per engine]
Four engines compute Jacobians; each prices a problem with its own terms and its own calibrated
constants (``calibrated.json``, fitted by ``python -m bench.calibrate``), in seconds and in bytes:

=================  ==========================================================  ==================
engine             what runs                                                   serves
=================  ==========================================================  ==================
forward            vmap over jvp, ``k`` tangents per pass                      every problem
forward-layerwise  Taylor mode over the captured program, op by op, no vmap    input Jacobians of
                                                                               a captured graph
reverse            vmap over vjp (per sample: vmap over samples of it)         every problem
reverse-probes     the probe engine: one probed forward pass, one reverse      per-sample
                   pass of the Y output directions down to the first probe,    parameter
                   closed-form blocks per module call (``_probes/``)           Jacobians
=================  ==========================================================  ==================

The generic engines' terms are those of the cost model in ``plan.py``. The probe engine's are its
own: the forward pass (``S * flops``, bytes, aten calls, the entries its convolutions and
transcendental maps write), the reverse pass of Y directions over the
*tail* of the forward pass only -- the work after the first call of a module whose parameters are
selected (``footprint.Tail``): the last layer's bias costs no reverse work at all -- one term per
covered module call, and the blocks it writes (B * Y * P entries, those of weights -- outer
products -- apart from those of biases -- copies; more per entry as the result outgrows
the caches: logarithmic in its size above ``SPILL_BYTES``, as the spill of the generic engines;
its pages when it is ``FRESH_BYTES`` or more). Where some selected parameters
have no rule, the generic per-sample reverse engine adds its cost for them. A specialised engine,
where it serves, runs its mode (the generic one is its fallback), so each mode has one price; the
planner takes the cheapest mode that fits the memory budget, and every engine it did not take says
why (:class:`Candidate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .._problem import Problem
from .calibrated import FRESH_BYTES, SPILL_BYTES, cost
from .footprint import Footprint
from .memory import fmt_bytes

WHAT = {
    "forward": "vmap over jvp",
    "forward-layerwise": "Taylor mode over the captured program",
    "reverse": "vmap over vjp",
    "reverse-probes": "probe engine",
}
BY_MODE = {"forward": ("forward-layerwise", "forward"), "reverse": ("reverse-probes", "reverse")}


@dataclass(frozen=True)
class Candidate:
    """One engine the planner considered for a call.

    Attributes:
        engine: "forward", "forward-layerwise", "reverse" or "reverse-probes" (see ``WHAT``).
        mode: the mode it runs.
        seconds: its predicted time (``math.inf`` when it cannot serve or fit).
        workspace_bytes: its predicted workspace on top of the result (0 when it cannot serve).
        chosen: whether the plan runs it.
        why: why it was not chosen, or why it cannot serve; "" for the chosen one.
    """

    engine: str
    mode: str
    seconds: float = math.inf
    workspace_bytes: int = 0
    chosen: bool = False
    why: str = ""

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.seconds)

    def __str__(self) -> str:
        head = f"{self.engine} ({WHAT[self.engine]})"
        if not self.feasible:
            return f"{head}: {self.why}"
        tail = "chosen" if self.chosen else self.why
        return f"{head} {self.seconds * 1e3:.3g} ms, {fmt_bytes(self.workspace_bytes)}: {tail}"


def serving(p: Problem, mode: str, strategy: str) -> str:
    """The engine that runs ``mode`` with ``strategy`` on ``p`` (the one ``_structure.run`` dispatches to)."""
    if mode == "reverse" and strategy == "per-sample" and getattr(p, "probes", None) is not None:
        return "reverse-probes"
    if mode == "forward" and strategy == "broadcast" and getattr(p, "program", None) is not None:
        return "forward-layerwise"
    return mode


def cannot(p: Problem, engine: str, strategy: str) -> str:
    """Why a specialised ``engine`` cannot serve ``p`` (for one the mode's serving engine supersedes)."""
    if engine == "forward-layerwise":
        if p.kind == "params":
            return "cannot serve: parameter tangents take vmap over jvp"
        if strategy != "broadcast":
            return f"cannot serve: it pushes shared seeds of independent samples, not the {strategy} strategy"
        return f"cannot serve: no captured program ({p.generic or 'not captured'})"
    if engine == "reverse-probes":
        if p.kind != "params":
            return "cannot serve: it differentiates parameters, not inputs"
        if strategy != "per-sample":
            return f"cannot serve: it needs independent samples (this call is {strategy})"
        return "cannot serve: no selected parameter's module has a rule that passed the completeness check"
    return "its mode's specialised engine runs instead (this one is its fallback)"


def probe_terms(p: Problem, fp: Footprint, sample_chunk: Optional[int]) -> dict[str, float]:
    """The probe engine's terms (see the note) for per-sample parameter Jacobians."""
    cov = p.probes
    tail = fp.tail
    B, Y = p.batch, p.n_out
    covered = sum(t.numel() for t in cov.tensors.values()) if cov is not None else p.n_in
    vectors = sum(t.numel() for t in cov.tensors.values() if t.dim() < 2) if cov is not None else 0
    t_flops = tail.flops if tail is not None else fp.flops
    t_conv = tail.conv_flops if tail is not None else fp.conv_flops
    t_act = tail.act if tail is not None else fp.act
    t_ops = tail.ops if tail is not None else fp.ops
    t_conv_out = tail.conv_out if tail is not None else fp.conv_out
    t_special = tail.special if tail is not None else fp.special
    s = sample_chunk or B
    n_chunks = math.ceil(B / s)
    pass_bytes = Y * s * t_act
    result = float(B * Y * covered)
    return {
        "call": 1.0,
        "pass_ops": float((fp.ops + t_ops) * n_chunks),
        "vmap_ops": float(Y * t_ops * n_chunks),  # the pull-back of Y rows: ops without a batching rule loop
        "calls": float((tail.calls if tail is not None else len(cov.covered) if cov else 1) * n_chunks),
        "pass_flops": B * fp.flops,
        "pass_conv": B * fp.conv_flops,
        "pass_bytes": B * fp.act,
        "dir_flops": Y * B * t_flops,
        "dir_conv": Y * B * t_conv,
        "pass_conv_out": B * fp.conv_out,  # the probed forward pass's convolutions
        "conv_out": B * Y * t_conv_out,  # those the pull-back crosses, per direction
        "special": B * (fp.special + Y * t_special),
        "dir_bytes": Y * B * t_act,
        "dir_spill": Y * B * t_act * max(0.0, math.log2(max(pass_bytes, 1.0) / SPILL_BYTES)),
        "result": float(B * Y * (covered - vectors)),  # blocks of weights: outer products
        "bias": float(B * Y * vectors),  # blocks of biases (and other vectors): copies of the cotangents
        "fresh": result * max(0.0, math.log2(result * p.dtype.itemsize / SPILL_BYTES)) if result else 0.0,
        "pages": fresh_pages(result, p.dtype.itemsize),
    }


def fresh_pages(entries: float, itemsize: int) -> float:
    """The bytes of a result of ``entries`` where it is new memory on every call (``FRESH_BYTES`` or more), else 0."""
    size = float(entries * itemsize)
    return size if size >= FRESH_BYTES else 0.0


def estimate(engine: str, terms: dict[str, float], device_type: str = "cpu") -> float:
    """Seconds: the calibrated constants of ``engine`` on ``device_type`` times its terms."""
    table = cost(device_type)
    constants = table.get(engine) or table[engine.split("-")[0]]
    return sum(constants.get(k, 0.0) * v for k, v in terms.items())


def probe_seconds(p: Problem, fp: Footprint, sample_chunk: Optional[int], generic: Any) -> float:
    """The probe engine's time; ``generic()``: the generic per-sample reverse time over all of P, of
    which the parameters no rule covers take their share (and the whole, without the constants)."""
    if "reverse-probes" not in cost(p.device.type):  # a data file from before the probe engine had constants
        return float(generic())
    seconds = estimate("reverse-probes", probe_terms(p, fp, sample_chunk), p.device.type)
    cov = p.probes
    if cov is not None and cov.uncovered:
        covered = sum(t.numel() for t in cov.tensors.values())
        seconds += float(generic()) * (1.0 - covered / max(p.n_in, 1))
    return seconds


def strategies(p: Problem) -> dict[str, tuple[str, int]]:
    """For each mode: (strategy, number of directions)."""
    B, N, Y = p.batch, p.n_in, p.n_out
    if p.structure == "diagonal":
        return {"forward": ("diagonal", 1), "reverse": ("diagonal", 1)}
    if not p.batched:
        return {"forward": ("full", N), "reverse": ("full", Y)}
    if p.kind == "params":
        reverse = ("whole-batch", B * Y) if p.structure == "coupled" else ("per-sample", Y)
        return {"forward": ("whole-batch", N), "reverse": reverse}
    if p.structure == "coupled":
        return {"forward": ("whole-batch", B * N), "reverse": ("whole-batch", B * Y)}
    return {"forward": ("broadcast", N), "reverse": ("broadcast", Y)}


def candidates(p: Problem, sized: dict[str, tuple], chosen: str, allowed: tuple[str, ...],
               why_not: str = "") -> tuple[Candidate, ...]:
    """Every engine considered: the serving one of each sized mode with its price, the others with
    why not. ``sized``: mode -> (strategy, directions, chunk, samples, workspace, seconds, cut, engine)."""
    out = []
    best = sized[chosen][5]
    for mode in ("forward", "reverse"):
        strategy = sized[mode][0] if mode in sized else strategies(p)[mode][0]
        runs = sized[mode][7] if mode in sized else serving(p, mode, strategy)
        for engine in BY_MODE[mode]:
            if engine != runs:
                if engine == mode or not engine.startswith(mode):
                    why = f"its fallback only: {WHAT[runs]} runs {mode} mode here"
                else:
                    why = cannot(p, engine, strategy)
                out.append(Candidate(engine, mode, why=why))
                continue
            if mode not in sized:
                why = (why_not or "f does not support this mode") if mode not in allowed else \
                    "even one direction per pass does not fit the memory budget"
                out.append(Candidate(engine, mode, why=why))
                continue
            seconds, ws = sized[mode][5], int(sized[mode][4])
            if mode == chosen:
                out.append(Candidate(engine, mode, seconds, ws, chosen=True))
            else:
                ratio = seconds / best if best > 0 else math.inf
                out.append(Candidate(engine, mode, seconds, ws, why=f"{ratio:.2g}x the chosen engine's time"))
    return tuple(out)
