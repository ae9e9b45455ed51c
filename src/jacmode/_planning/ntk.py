"""How ``jm.ntk(method="auto")`` chooses between contraction, products and structured.

NOTE: [NTK cost model]
As neural-tangents does, the cost of each method is counted from the sizes: B1, B2 samples, Y
outputs per sample, P parameters and F, the flops of one forward pass per sample (measured by
``_planning/footprint.py``, convolutions included). With J(B) = B * Y * (F + P), the work of the
per-sample reverse passes that form B Jacobian rows and write them,

    contraction = c0 + c1 * (J(B1) + J(B2)) + c2 * B1 * B2 * Y^2 * P                     + c3 * R
    products    = c0 + c1 * J(B1)           + c2 * B1 * Y * B2 * F                     + c3 * R
    structured  = c0 + c1 * (B1 + B2) * Y * F + c2 * B1 * B2 * (Y^2 * sum_l (O_l + 1) + sum_l I_l) + c3 * R

(structured: per covered Linear layer l with I_l inputs and O_l outputs; Y^2 * P_l for other
covered layers, whose Gram blocks come from per-sample blocks), R = B1 * B2 * Y^2 the entries of
the result, written (and for products transposed) once. Unlike neural-tangents, which counts
flops only, each method has its own seconds per unit (c0, c1, c2, c3), fitted by
``python -m bench.calibrate_ntk --write`` to timings on a grid of shapes (wide P, wide Y,
deep, convolutional), since a vectorised jvp, a matrix product and a per-sample vjp run at very
different rates. The grid, the fit and the regret of the choice are in docs/products.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

# seconds per unit, per method: (c0, c1, c2, c3); fitted by bench.calibrate_ntk (1 thread), stored in
# calibrated.json
from .calibrated import NTK_COST

METHODS = ("contraction", "products", "structured")


@dataclass(frozen=True)
class Sizes:
    """The sizes the NTK cost model reads."""

    b1: int
    b2: int
    y: int
    p: int
    flops: float  # forward flops per sample
    pair: Optional[float] = None  # structured work per pair of samples (see pair_work); None: cannot run


def features(method: str, s: Sizes) -> tuple[float, ...]:
    """The four terms (1, work of the passes, work of the products, result entries) of ``method``."""
    jac = lambda b: b * s.y * (s.flops + s.p)  # noqa: E731
    result = float(s.b1 * s.b2 * s.y * s.y)
    if method == "contraction":
        return (1.0, jac(s.b1) + jac(s.b2), float(s.b1 * s.b2 * s.y * s.y * s.p), result)
    if method == "products":
        return (1.0, jac(s.b1), float(s.b1 * s.y * s.b2) * max(s.flops, 1.0), result)
    return (1.0, (s.b1 + s.b2) * s.y * max(s.flops, 1.0), float(s.b1 * s.b2 * (s.pair or 0.0)), result)


def estimate(method: str, s: Sizes) -> float:
    """Estimated seconds of ``method`` on these sizes."""
    return sum(c * t for c, t in zip(NTK_COST[method], features(method, s)))


@dataclass(frozen=True)
class NtkPlan:
    """What :func:`jacmode.ntk` will do for a call, and why (its ``repr``).

    Attributes:
        method: "contraction", "products" or "structured".
        costs: estimated seconds of every method that can run.
        sample_chunk: samples per Jacobian block (contraction, products).
        reason: one line on why.
    """

    method: str
    costs: dict[str, float] = field(default_factory=dict)
    sample_chunk: int = 0
    reason: str = ""

    def __repr__(self) -> str:
        est = ", ".join(f"{m} {1e3 * t:.3g} ms" for m, t in sorted(self.costs.items(), key=lambda kv: kv[1]))
        return (f"NtkPlan(method={self.method!r}, sample_chunk={self.sample_chunk})\n"
                f"  estimated: {est}\n  why: {self.reason}")


def choose(s: Sizes, method: str, sample_chunk: int, no_forward: Optional[str] = None) -> NtkPlan:
    """The plan for ``method`` ("auto" picks the cheapest estimate among those that can run).

    ``no_forward`` says why forward mode is not exact for f (then products, a jvp, cannot run).
    """
    runnable = [m for m in METHODS if (m != "structured" or s.pair is not None)
                and (m != "products" or no_forward is None)]
    costs = {m: estimate(m, s) for m in runnable}
    sizes = f"B1={s.b1}, B2={s.b2}, Y={s.y}, P={s.p}, forward {s.flops:.3g} flops/sample"
    cover = "" if s.pair is not None else "; structured needs a per-layer rule for every selected parameter"
    if no_forward is not None:
        cover += f"; products needs forward mode, not exact for {no_forward}"
    if method != "auto":
        return NtkPlan(method, costs, sample_chunk, f"method={method!r} was asked for ({sizes})")
    best = min(costs, key=lambda m: costs[m])
    return NtkPlan(best, costs, sample_chunk, f"lowest estimated time at {sizes}{cover}")


def pair_work(cov: Any, y: int) -> float:
    """Structured work per pair of samples: Y^2 * (O + 1) + I per Linear layer (closed-form Gram),
    Y^2 * E + V per EmbeddingBag, Y^2 * (its parameters) for other covered layers (Gram of
    per-sample blocks)."""
    work = 0.0
    for module in cov.modules:
        if type(module) is nn.Linear:
            work += y * y * (module.out_features + 1) + module.in_features
        elif type(module) is nn.EmbeddingBag:  # closed form too: (c1 c2^T) * (G1 . G2)
            work += y * y * module.embedding_dim + module.num_embeddings
        else:
            work += y * y * sum(p.numel() for p in module.parameters(recurse=False))
    return work
