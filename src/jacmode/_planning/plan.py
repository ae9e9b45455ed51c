"""The planner: which mode, which strategy, how many directions per vectorised pass, and why.

NOTE: [Cost model]
A call is a sequence of vectorised passes. Forward mode pushes ``k`` tangents per pass and re-runs
the primal computation in every pass; reverse mode records the tape once and pulls ``k``
cotangents per pass. With the footprint of ``f`` per sample (aten calls ``ops``, matmul ``flops``,
convolution ``conv`` flops, bytes produced ``act``; see ``_planning/footprint.py``) and S samples per
direction, the estimated time is

    t = call + ops * (pass_ops * passes + vmap_ops * vmapped passes)
        + S * (pass_flops * flops + pass_conv * conv + pass_bytes * act) * primal passes
        + S * (dir_flops * flops + dir_conv * conv + dir_bytes * act) * directions
        + S * dir_spill * act * directions * max(0, log2(bytes of one pass / SPILL_BYTES))
        + S * conv_out * (positions the convolutions write) * (directions + primal passes)
        + S * conv_spill * (positions) * directions * max(0, log2(bytes of one pass / SPILL_BYTES))
        + S * special * (entries of transcendental maps: tanh, GELU, ...) * (directions + primal passes)
        + result * B*Y*N + pages * (bytes of a result of at least FRESH_BYTES)
        + seed * N*directions (a built one-hot seed, forward over a captured graph)

with one set of constants per engine (forward, forward layer by layer, reverse; see ``engine``),
fitted to timings over a grid of MLPs, elementwise-heavy nets and a small CNN (wrt inputs and
parameters, N/Y from 1/1000 to 1000/1, B from 1 to 1024) by ``python -m bench.calibrate``; they
live in ``_planning/calibrated.json`` (read by ``calibrated.py``). Small problems are dominated by the fixed and per-pass terms, large
ones by the per-direction work, which costs more per byte as the activations of one pass outgrow
the caches (``dir_spill``: logarithmic in the pass size above ``SPILL_BYTES``). Convolutions
with few channels run far below their flop rate: they also cost per position written (images x
spatial entries, whatever the channels: ``conv_out``), and more so once a pass outgrows the caches
(``conv_spill``); transcendental elementwise maps (tanh, sigmoid, GELU, SiLU, exp) cost several
times a ReLU per entry (``special``); and a result of ``FRESH_BYTES`` or more is new memory on every call, whose pages
fault on first write (``pages``; a caller's ``out=`` avoids it). docs/modes.md
shows the fitted constants, the crossover and the regret of the choice. The strategy fixes how
many directions there are:

=============  =====================  ==========================
strategy       forward directions     reverse directions
=============  =====================  ==========================
broadcast      D (seeds shared by     Y
               independent samples)
per-sample     --                     Y per sample (vmap over samples of vmap over Y)
whole-batch    B*D (inputs) or P      B*Y
full           N = numel(x)           Y = numel(f(x))
diagonal       1                      1
=============  =====================  ==========================

Parameter tangents are shared by all samples, so forward mode over parameters is "whole-batch"
and exact even for coupled samples; reverse mode over parameters is "per-sample" (a vmap over
samples), which needs independent samples, or "whole-batch" (B times the work) when coupled.
Chunk sizes are the largest that keep the workspace inside the memory budget (``_planning/chunking.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .._capture.taylor import seed_built
from .._problem import Problem
from . import engines as _engines
from .calibrated import SPILL_BYTES
from .chunking import chunks, engine, pass_workspace, samples_per_direction
from .engines import Candidate, strategies
from .footprint import Footprint
from .memory import fmt_bytes

MODES = ("forward", "reverse")


@dataclass(frozen=True)
class Plan:
    """What :func:`jacmode.jacobian` will do for a call, and why.

    Attributes:
        mode: "forward" or "reverse".
        strategy: "broadcast", "per-sample", "whole-batch", "full", "diagonal" or "sparse".
        directions: tangents (forward) or cotangents (reverse) pushed in all (per sample for
            the per-sample strategy).
        chunk_size: directions per vectorised pass.
        sample_chunk: samples per vectorised pass (per-sample strategy), else None.
        costs: estimated time in seconds of each candidate mode (measured ones with autotune).
        result_bytes: size of the result.
        workspace_bytes: estimated peak memory on top of the result.
        budget_bytes: the workspace budget the chunk sizes were chosen for.
        loop: None for the vectorised engines; "samples" for a Python loop over samples,
            "autograd" for plain ``torch.autograd.grad`` loops (fallbacks, see ``_autodiff/fallback.py``).
        reason: one line on why this mode and strategy were chosen.
        coloring: for strategy "sparse", the :class:`jacmode.Coloring` used (colours, lower
            bound, partition; see docs/sparse.md), else None.
        engine: the engine that runs the plan: "forward", "forward-layerwise", "reverse" or
            "reverse-probes" ("" for the sparse and fallback paths).
        candidates: every engine considered (:class:`~jacmode._planning.engines.Candidate`): its
            predicted time and workspace, or why it cannot serve, and why the chosen one won.
    """

    mode: str
    strategy: str
    directions: int
    chunk_size: int
    sample_chunk: Optional[int]
    costs: dict[str, float] = field(default_factory=dict)
    result_bytes: int = 0
    workspace_bytes: int = 0
    budget_bytes: int = 0
    loop: Optional[str] = None
    reason: str = ""
    coloring: Optional[Any] = None
    engine: str = ""
    candidates: tuple[Candidate, ...] = ()

    @property
    def peak_bytes(self) -> int:
        """Estimated peak memory of the call: the result plus the workspace."""
        return self.result_bytes + self.workspace_bytes

    def __repr__(self) -> str:
        costs = ", ".join(f"{m}={c * 1e3:.3g} ms" for m, c in self.costs.items())
        chunks = _dirs(self.chunk_size)
        if self.sample_chunk is not None:
            chunks += f" x {self.sample_chunk} samples"
        loop = f", loop={self.loop!r}" if self.loop else ""
        return (
            f"Plan(mode={self.mode!r}, strategy={self.strategy!r}, directions={self.directions}, "
            f"chunk={chunks} per pass{loop}, est. time [{costs}], "
            f"memory={fmt_bytes(self.result_bytes)} result + {fmt_bytes(self.workspace_bytes)} "
            f"workspace (budget {fmt_bytes(self.budget_bytes)}))\n  why: {self.reason}"
            + "".join(f"\n  - {c}" for c in self.candidates)
        )


def _dirs(n: int) -> str:
    return f"{n} direction{'' if n == 1 else 's'}"


def features(p: Problem, fp: Footprint, mode: str, strategy: str, directions: int, chunk: int,
             sample_chunk: Optional[int]) -> dict[str, float]:
    """The terms of the cost model (see the note) for one candidate."""
    S = samples_per_direction(p, strategy)
    n_chunks = math.ceil(directions / chunk)
    pass_bytes = chunk * (sample_chunk or S) * fp.act  # activations of one pass
    spill = max(0.0, math.log2(max(pass_bytes, 1.0) / SPILL_BYTES))  # doublings of a pass beyond SPILL_BYTES
    entries = p.batch * p.n_out * p.n_in  # of the result
    if strategy == "per-sample":
        n_samples = math.ceil(p.batch / (sample_chunk or p.batch))
        passes, vmapped, primal = n_samples * (1 + n_chunks), n_samples * (1 + n_chunks), 1
    elif mode == "forward":
        passes, vmapped, primal = n_chunks, n_chunks if chunk > 1 else 0, n_chunks
    else:
        passes, vmapped, primal = 1 + n_chunks, n_chunks if chunk > 1 else 0, 1
    return {
        "call": 1.0,
        "pass_ops": fp.ops * passes,
        "vmap_ops": fp.ops * vmapped,
        "pass_flops": S * fp.flops * primal,
        "pass_conv": S * fp.conv_flops * primal,
        "pass_bytes": S * fp.act * primal,
        "dir_flops": S * fp.flops * directions,
        "dir_conv": S * fp.conv_flops * directions,
        "dir_bytes": S * fp.act * directions,
        "dir_spill": S * fp.act * directions * spill,
        "conv_out": S * fp.conv_out * (directions + primal),
        "conv_spill": S * fp.conv_out * directions * spill,
        "special": S * fp.special * (directions + primal),
        "result": float(entries),
        "pages": _engines.fresh_pages(entries, p.dtype.itemsize),
        "seed": _seed_elements(p, mode, strategy, directions, S),
    }


def _seed_elements(p: Problem, mode: str, strategy: str, directions: int, S: int) -> float:
    """The entries of the one-hot seeds forward mode builds: directions x P for parameter tangents
    (each direction a one-hot of every parameter: P x P in all, which dominates at large P); over
    a captured graph, directions x N when a first operation reads the seed as a tensor (an
    elementwise map, a norm; the (k, S, N) tangents it then makes cost more per byte at large N
    than the fit grid's nets show), 0 when the linear maps that read the input take their columns
    instead (``_capture/taylor.py``, [Seeds as columns] in ``_rules/base.py``)."""
    if mode == "forward" and p.kind == "params":
        return float(directions * p.n_in)
    program = getattr(p, "program", None)
    if program is None or mode != "forward" or strategy != "broadcast":
        return 0.0
    return float(directions * p.n_in) if seed_built(program, p.in_shape, p.z) else 0.0


estimate = _engines.estimate


def seconds(p: Problem, fp: Footprint, mode: str, strategy: str, directions: int, chunk: int,
            sample_chunk: Optional[int]) -> float:
    """The predicted time of the engine that runs ``mode`` with ``strategy`` (see ``engines.py``)."""
    name = engine(p, mode, strategy)
    kind = p.device.type
    generic = lambda: estimate(mode, features(p, fp, mode, strategy, directions, chunk, sample_chunk), kind)  # noqa: E731
    if name == "reverse-probes":
        return _engines.probe_seconds(p, fp, sample_chunk, generic)
    return estimate(name, features(p, fp, mode, strategy, directions, chunk, sample_chunk), kind)


def minimum_workspace(p: Problem, fp: Footprint, mode: str) -> float:
    """The workspace of the smallest pass of ``mode`` (one direction, one sample)."""
    strategy, _ = strategies(p)[mode]
    return pass_workspace(p, fp, mode, strategy, 1, 1)


def make_plan(
    p: Problem,
    fp: Footprint,
    mode: str,
    chunk_size: Optional[int],
    budget: float,
    *,
    allowed: tuple[str, ...] = MODES,
    loops: Optional[dict[str, str]] = None,
    why: str = "",
) -> Optional[Plan]:
    """Choose mode (unless given), strategy and chunk sizes; None if nothing fits the budget.

    Args:
        p: the problem; fp: the footprint of its function.
        mode: "auto", "forward" or "reverse".
        chunk_size: the user's cap on directions (x samples, per-sample) per pass, or None.
        budget: workspace bytes allowed on top of the result.
        allowed: the modes that ``f`` supports (see ``_autodiff/fallback.py``).
        loops: mode -> the fallback engine it must use ("samples", "autograd"), if any.
        why: what the fallback was; appended to the reason.
    """
    options = strategies(p)
    loops = loops or {}
    sized = {}
    for m in (allowed if mode == "auto" or mode in allowed else (*allowed, mode)):
        strategy, directions = options[m]
        cap = 1 if loops.get(m) == "samples" else None
        fit = chunks(p, fp, m, strategy, directions, chunk_size, budget, cap)
        if fit is not None:
            chunk, samples, ws, cut = fit
            cost = seconds(p, fp, m, strategy, directions, chunk, samples)
            sized[m] = (strategy, directions, chunk, samples, ws, cost, cut, engine(p, m, strategy))
    if not sized or (mode != "auto" and mode not in sized):
        return None
    costs = {m: v[5] for m, v in sized.items()}
    chosen = min(costs, key=lambda m: costs[m]) if mode == "auto" else mode
    strategy, directions, chunk, samples, ws, _, cut, runs = sized[chosen]
    if mode != "auto":
        reason = f"mode={mode!r} was requested"
        best = min(costs, key=lambda m: costs[m])
        if best != mode:
            reason += f" (the cost model expects {best} to be {costs[mode] / costs[best]:.1f}x faster)"
        if strategy == "per-sample" and p.probes is not None:
            reason += f"; {probes_reason(p.probes)}"
        elif p.kind == "inputs" and p.program is not None and (mode, strategy) == ("forward", "broadcast"):
            reason += f"; {_captured(p.program)}"
        elif p.kind == "inputs" and p.generic:
            reason += f"; generic engine: {p.generic}"
    else:
        reason = _reason(p, chosen, sized, allowed)
    if chunk < directions or (samples is not None and samples < p.batch):
        per = _dirs(chunk) + (f" x {samples} samples" if samples is not None else "")
        why_chunked = (f"to stay inside the memory budget ({fmt_bytes(budget)})" if cut
                       else "as chunk_size asks" if chunk_size else "to keep each pass's blocks small")
        reason += f"; {per} per pass {why_chunked}"
    if why:
        reason += f"; {why}"
    result_bytes = p.dtype.itemsize * (p.n_in if p.structure == "diagonal" else p.batch * p.n_out * p.n_in)
    return Plan(mode=chosen, strategy=strategy, directions=directions, chunk_size=chunk,
                sample_chunk=samples, costs=costs, result_bytes=result_bytes,
                workspace_bytes=int(ws), budget_bytes=int(min(budget, 2**62)), loop=loops.get(chosen),
                reason=reason, engine=runs if chosen not in loops else "",
                candidates=_engines.candidates(p, sized, chosen, allowed, why))


def with_reason(plan: Plan, reason: str, costs: Optional[dict[str, float]] = None) -> Plan:
    """The same plan with another reason (and measured costs)."""
    return replace(plan, reason=reason, costs=costs if costs is not None else plan.costs)


def _reason(p: Problem, mode: str, sized: dict[str, tuple], allowed: tuple[str, ...]) -> str:
    strategy, n, chunk, _, _, cost, _, runs = sized[mode]
    what = {"inputs": "input features D", "params": "parameters P"}[p.kind]
    if strategy == "diagonal":
        return "elementwise f: one forward-mode pass with a tangent of ones gives the whole diagonal"
    axes = f"{what}={p.n_in}, outputs Y={p.n_out}, B={p.batch}"
    others = [m for m in sized if m != mode]
    if others:
        other = others[0]
        ratio = sized[other][5] / cost if cost > 0 else math.inf
        versus = (f"{mode} needs {_dirs(n)} vs {sized[other][1]}; {runs} ({_engines.WHAT[runs]}) is "
                  f"{ratio:.1f}x faster than {sized[other][7]} by the cost model")
    elif len(allowed) > 1:
        versus = f"{mode} ({_dirs(n)}) is the only mode whose smallest pass fits the memory budget"
    else:
        versus = f"{mode} ({_dirs(n)}) is the only mode f supports"
    layerwise = p.program is not None and (mode, strategy) == ("forward", "broadcast")
    extra = {
        "broadcast": "; samples are independent, so each seed is shared by all B samples",
        "per-sample": "; parameters are shared, so each sample gets its own rows",
        "whole-batch": "; samples are coupled, so the whole batch is differentiated as one point"
        if p.structure == "coupled" else "",
    }.get(strategy, "")
    if layerwise and p.program is not None:
        extra += f" ({_captured(p.program)})"
    elif strategy == "per-sample" and mode == "reverse" and p.probes is not None:
        extra += f" ({probes_reason(p.probes)})"
    elif p.kind == "inputs" and p.generic:
        extra += f" (generic engine: {p.generic})"
    elif strategy == "per-sample":
        extra += " (vmap over samples)"
    return f"{axes}: {versus}{extra}"


def _captured(program: Any) -> str:
    """What the captured graph runs, and the tensors of f it reads again on each call (``_capture/bound.py``)."""
    wheres = [b.where for b in program.bound]
    shown = ", ".join(wheres[:3]) + (f" and {len(wheres) - 3} more" if len(wheres) > 3 else "")
    reads = f"; reads f's tensors {shown} on each call" if wheres else ""
    return f"captured graph of {', '.join(program.ops)}: propagated op by op, no vmap{reads}"


def probes_reason(cov: Any) -> str:
    """Which parameters the layer-wise probe engine covers, and why the others take the generic one."""
    local = sorted({type(m).__name__ for m, r in cov.rules.items() if type(r).__name__ == "LocalVmapRule"})
    n_local = sum(1 for m, _ in cov.covered.values() if type(cov.rules[m]).__name__ == "LocalVmapRule")
    text = f"layer-wise probes and per-module rules for {len(cov.covered) - n_local} parameter tensors"
    if local:
        text += f", module-local vmap for {n_local} of {', '.join(local)}"
    if cov.uncovered:
        rest = "; ".join(f"{n}: {why}" for n, why in cov.uncovered.items())
        text += f"; vmap over samples for {rest}"
    return text
