"""Chunk sizes: the largest vectorised passes whose estimated workspace fits the memory budget.

The workspace of one pass comes from ``_memory.workspace`` (see the memory note there); this
module knows what a pass of each strategy holds (seeds, products, samples) and which engine runs
it, and picks directions (and, per-sample, samples) per pass, largest first.
"""

from __future__ import annotations

from typing import Optional

from .._problem import Problem
from .engines import serving
from .footprint import Footprint
from .memory import largest_fitting, workspace

# Per-sample parameter blocks are written in chunks of at most this many bytes, which keeps the
# workspace small and re-usable by the allocator (see the memory note in _structure.py).
SAMPLE_BLOCK_BYTES = 16 * 2**20
# Without a chunk size, the seeds and products of one vectorised pass are kept under this size
# whatever the budget; e.g. forward mode over P = 15,910 parameters never builds the dense P x P
# identity.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def samples_per_direction(p: Problem, strategy: str) -> int:
    """Samples each direction is pushed through (the footprint of full/diagonal is of all of x)."""
    return 1 if strategy in ("full", "diagonal") else p.batch


def engine(p: Problem, mode: str, strategy: str) -> str:
    """Which engine runs a candidate: "forward", "reverse", "forward-layerwise" or "reverse-probes".

    Through a captured graph whose operations all have rules, forward mode over broadcast seeds
    pushes the tangents op by op (``_capture/taylor.py``); per-sample parameter Jacobians of modules
    with rules run the probe engine (``_probes/layerwise.py``): no dual tensors, no vmap, and their
    own measured costs (see [One cost per engine] in ``engines.py``).
    """
    return serving(p, mode, strategy)


def pass_workspace(p: Problem, fp: Footprint, mode: str, strategy: str, k: int, s: int) -> float:
    """Estimated workspace in bytes of one pass of k directions (over s samples, per-sample)."""
    isz = p.z.element_size()
    S = samples_per_direction(p, strategy)
    if strategy == "per-sample":  # the probe engine writes the blocks straight into the result
        copies = 0 if engine(p, mode, strategy) == "reverse-probes" else p.n_in * isz
        return workspace(mode, k=k, samples=s, act=fp.act, peak=fp.peak, per_sample=True,
                                 seed_bytes=p.n_out * isz, block_bytes=0, param_bytes=copies)
    seed = {"broadcast": p.n_in, "whole-batch": p.z.numel(), "full": p.n_in, "diagonal": p.n_in}[strategy]
    if p.kind == "params" and mode == "forward":
        seed = p.n_in
    block = S * p.n_out if mode == "forward" else p.z.numel()
    return workspace(mode, k=k, samples=S, act=fp.act, peak=fp.peak,
                             seed_bytes=seed * isz, block_bytes=2 * block * isz)


def chunks(p: Problem, fp: Footprint, mode: str, strategy: str, directions: int,
            chunk_size: Optional[int], budget: float,
            sample_cap: Optional[int] = None) -> Optional[tuple[int, Optional[int], float, bool]]:
    """(directions per pass, samples per pass, workspace, cut by the budget?); None if none fits."""
    if strategy == "per-sample":
        Y, B = p.n_out, max(1, min(p.batch, sample_cap or p.batch))
        if engine(p, mode, strategy) == "reverse-probes":  # all Y at once; chunks of samples only
            s_fit = largest_fitting(lambda n: pass_workspace(p, fp, mode, strategy, Y, n) <= budget,
                                            min(B, max(1, chunk_size // Y)) if chunk_size else B)
            return (Y, s_fit, pass_workspace(p, fp, mode, strategy, Y, s_fit), s_fit < B) if s_fit else None
        if chunk_size is not None:
            c = min(Y, chunk_size)
            s = min(B, max(1, chunk_size // c))
        else:
            c = Y
            per_sample = max(1, Y * p.n_in * p.z.element_size())
            s = B if B * per_sample <= 4 * SAMPLE_BLOCK_BYTES else max(1, min(B, SAMPLE_BLOCK_BYTES // per_sample))
        s_fit = largest_fitting(lambda n: pass_workspace(p, fp, mode, strategy, c, n) <= budget, s)
        if s_fit == 0:
            c = largest_fitting(lambda k: pass_workspace(p, fp, mode, strategy, k, 1) <= budget, c)
            s_fit = 1
        if c == 0:
            return None
        return c, s_fit, pass_workspace(p, fp, mode, strategy, c, s_fit), s_fit < s or c < min(Y, chunk_size or Y)
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_BYTES // (p.z.element_size() * _per_direction_elements(p)))
    upper = max(1, min(directions, chunk_size))
    c = largest_fitting(lambda k: pass_workspace(p, fp, mode, strategy, k, 0) <= budget, upper)
    if c == 0:
        return None
    return c, None, pass_workspace(p, fp, mode, strategy, c, 0), c < upper


def _per_direction_elements(p: Problem) -> int:
    """Elements of one direction's seed plus its product (the inputs and outputs of one jvp/vjp)."""
    batch_in = p.batch * p.n_in if p.kind == "inputs" else p.n_in
    return max(1, batch_in + p.batch * p.n_out)
