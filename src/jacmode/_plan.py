"""The planner: which mode, which strategy, how many directions per vectorised pass, and why.

NOTE: [Cost model]
Costs are counted in batched forward passes. Forward mode pushes one tangent per input direction;
each costs about ``FORWARD_PER_DIRECTION`` forward passes and needs no tape. Reverse mode runs one
forward pass to record the tape, then pulls one cotangent per output direction at about
``REVERSE_PER_DIRECTION`` passes each. The strategy fixes how many directions there are:

=============  =====================  ==========================
strategy       forward directions     reverse directions
=============  =====================  ==========================
broadcast      D (seeds shared by     Y
               independent samples)
per-sample     --                     Y per sample, B*Y in all, each 1/B of a pass
whole-batch    B*D (inputs) or P      B*Y
full           N = numel(x)           Y = numel(f(x))
diagonal       1                      1
=============  =====================  ==========================

Parameter tangents are shared by all samples, so forward mode over parameters is "whole-batch"
and exact even for coupled samples; reverse mode over parameters is "per-sample" (a vmap over
samples), which needs independent samples, or "whole-batch" (B times the work) when they are coupled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ._problem import Problem

FORWARD_PER_DIRECTION = 1.5
REVERSE_PER_DIRECTION = 2.0
TAPE = 1.0
# Per-sample parameter blocks are written in chunks of at most this many bytes, which keeps the
# workspace small and re-usable by the allocator (see the memory note in _structure.py).
SAMPLE_BLOCK_BYTES = 16 * 2**20
# Without a chunk size, the seeds and products of one vectorised pass are kept under this size;
# e.g. forward mode over P = 15,910 parameters never builds the dense P x P identity.
DEFAULT_CHUNK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Plan:
    """What :func:`jacmode.jacobian` will do for a call, and why.

    Attributes:
        mode: "forward" or "reverse".
        strategy: "broadcast", "per-sample", "whole-batch", "full" or "diagonal".
        directions: tangents (forward) or cotangents (reverse) pushed in all.
        chunk_size: directions per vectorised pass.
        sample_chunk: samples per vectorised pass (per-sample strategy), else None.
        costs: estimated cost of each candidate mode, in batched forward passes.
        result_bytes: size of the result.
        reason: one line on why this mode and strategy were chosen.
    """

    mode: str
    strategy: str
    directions: int
    chunk_size: int
    sample_chunk: Optional[int]
    costs: dict[str, float] = field(default_factory=dict)
    result_bytes: int = 0
    reason: str = ""

    def __repr__(self) -> str:
        costs = ", ".join(f"{m}={c:.3g}" for m, c in self.costs.items())
        chunks = f"{self.chunk_size} directions"
        if self.sample_chunk is not None:
            chunks += f" x {self.sample_chunk} samples"
        return (
            f"Plan(mode={self.mode!r}, strategy={self.strategy!r}, directions={self.directions}, "
            f"chunk={chunks} per pass, est. cost [{costs}] forward passes, "
            f"result={_fmt_bytes(self.result_bytes)})\n  why: {self.reason}"
        )


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def candidates(p: Problem) -> dict[str, tuple[str, int, float]]:
    """For each mode: (strategy, number of directions, estimated cost in forward passes)."""
    fwd, rev = FORWARD_PER_DIRECTION, REVERSE_PER_DIRECTION
    B, N, Y = p.batch, p.n_in, p.n_out
    if p.structure == "diagonal":
        return {"forward": ("diagonal", 1, fwd), "reverse": ("diagonal", 1, TAPE + rev)}
    if not p.batched:
        return {"forward": ("full", N, N * fwd), "reverse": ("full", Y, TAPE + Y * rev)}
    if p.kind == "params":
        if p.structure == "coupled":
            reverse = ("whole-batch", B * Y, TAPE + B * Y * rev)
        else:
            reverse = ("per-sample", B * Y, TAPE + Y * rev)
        return {"forward": ("whole-batch", N, N * fwd), "reverse": reverse}
    if p.structure == "coupled":
        return {"forward": ("whole-batch", B * N, B * N * fwd), "reverse": ("whole-batch", B * Y, TAPE + B * Y * rev)}
    return {"forward": ("broadcast", N, N * fwd), "reverse": ("broadcast", Y, TAPE + Y * rev)}


def make_plan(p: Problem, mode: str, chunk_size: Optional[int]) -> Plan:
    """Choose mode (unless given), strategy and chunk sizes for a problem."""
    options = candidates(p)
    costs = {m: c for m, (_, _, c) in options.items()}
    if mode == "auto":
        mode = min(costs, key=lambda m: costs[m])
        other = "reverse" if mode == "forward" else "forward"
        reason = _reason(p, mode, other, options)
    else:
        reason = f"mode={mode!r} was requested"
    strategy, directions, _ = options[mode]
    itemsize = p.z.element_size()
    result_bytes = p.batch * p.n_out * p.n_in * itemsize if p.structure != "diagonal" else p.n_in * itemsize
    sample_chunk = None
    if strategy == "per-sample":
        per_sample = max(1, p.n_out * p.n_in * itemsize)
        if chunk_size is not None:
            chunk = min(p.n_out, chunk_size)
            sample_chunk = max(1, chunk_size // chunk)
        else:
            chunk = p.n_out
            sample_chunk = max(1, min(p.batch, SAMPLE_BLOCK_BYTES // per_sample))
            if p.batch * per_sample <= 4 * SAMPLE_BLOCK_BYTES:
                sample_chunk = max(1, p.batch)
        directions = p.n_out
    else:
        if chunk_size is None:
            chunk_size = max(1, DEFAULT_CHUNK_BYTES // (itemsize * _per_direction_elements(p)))
        chunk = max(1, min(directions, chunk_size))
    return Plan(
        mode=mode,
        strategy=strategy,
        directions=directions,
        chunk_size=chunk,
        sample_chunk=sample_chunk,
        costs=costs,
        result_bytes=result_bytes,
        reason=reason,
    )


def _per_direction_elements(p: Problem) -> int:
    """Elements of one direction's seed plus its product (the inputs and outputs of one jvp/vjp)."""
    batch_in = p.batch * p.n_in if p.kind == "inputs" else p.n_in
    batch_out = p.batch * p.n_out
    return max(1, batch_in + batch_out)


def _reason(p: Problem, mode: str, other: str, options: dict[str, tuple[str, int, float]]) -> str:
    strategy, n, cost = options[mode]
    _, n_other, cost_other = options[other]
    what = {"inputs": "input features D", "params": "parameters P"}[p.kind]
    if strategy == "diagonal":
        return "elementwise f: one forward-mode pass with a tangent of ones gives the whole diagonal"
    ratio = cost_other / cost if cost > 0 else math.inf
    axes = f"{what}={p.n_in}, outputs Y={p.n_out}, B={p.batch}"
    extra = ""
    if strategy == "broadcast":
        extra = "; samples are independent, so each seed is shared by all B samples"
    elif strategy == "per-sample":
        extra = "; parameters are shared, so samples are vectorised with vmap"
    elif strategy == "whole-batch" and p.structure == "coupled":
        extra = "; samples are coupled, so the whole batch is differentiated as one point"
    return f"{axes}: {mode} needs {n} directions vs {n_other} ({ratio:.1f}x cheaper by the cost model){extra}"
