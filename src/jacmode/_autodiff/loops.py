"""Slow but sure engines for the fallbacks (see the note in ``_autodiff/fallback.py``).

* ``sample_loop``: per-sample parameter Jacobians with a Python loop over samples, each with vmap
  over chunks of output directions (for ``f`` that vmap cannot batch over samples).
* ``autograd_rows``: plain ``torch.autograd.grad`` loops, one backward pass per output direction
  (broadcast over independent samples where the strategy allows), for ``f`` that no
  ``torch.func`` transform can run.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.func import vjp

from .._planning.plan import Plan
from .._problem import Problem
from .reverse import pullback, recording


def sample_loop(p: Problem, plan: Plan, out: Optional[Tensor]) -> Tensor:
    """(B, Y, P): one sample at a time, ``plan.chunk_size`` output directions per vmap."""
    assert p.sample_fn is not None
    B, Y = p.batch, p.n_out
    res = out if out is not None else p.z.new_zeros(B, Y, p.n_in)
    eye = torch.eye(Y, dtype=p.z.dtype, device=p.z.device)
    with recording() as kept:  # see [Grad mode of the reverse engines]
        for b in range(B):
            xb = p.x[b].clone()  # f may modify its input in place
            _, vjp_fn = vjp(lambda z: p.sample_fn(z, xb), p.z)  # type: ignore[misc]
            for y0 in range(0, Y, plan.chunk_size):
                y1 = min(Y, y0 + plan.chunk_size)
                res[b, y0:y1] = kept(pullback(vjp_fn, eye[y0:y1]))
    return res


def autograd_rows(p: Problem, plan: Plan, out: Optional[Tensor], create_graph: bool,
                  fn: Callable[[Tensor], Tensor]) -> Tensor:
    """The flat result (see ``_structure``) from one ``torch.autograd.grad`` per output entry.

    ``fn`` is ``p.fn`` or, for parameters, the same function on a copy of x (plain autograd runs
    in-place operations of f for real, which must not reach the user's x).
    """
    z = p.z if p.z.requires_grad else p.z.detach().requires_grad_(True)
    B, Y, N = p.batch, p.n_out, p.n_in

    def grad(y: Tensor, keep: bool = True) -> Tensor:
        (g,) = torch.autograd.grad(y, z, retain_graph=keep or create_graph, create_graph=create_graph,
                                   allow_unused=True)
        return torch.zeros_like(z) if g is None else g

    with torch.enable_grad():
        if plan.strategy == "diagonal":
            return grad(fn(z).sum(), keep=False)
        if not p.batched:
            o = fn(z)
            return torch.stack([grad(o[y]) for y in range(Y)]).reshape(Y, N)
        res = out if out is not None else z.new_zeros(B, Y, N)
        if p.kind == "params" and plan.strategy == "per-sample":
            for b in range(B):
                o = p.sample_fn(z, p.x[b].clone())  # type: ignore[misc]
                for y in range(Y):
                    res[b, y] = grad(o[y])
            return res
        o = fn(z)
        if plan.strategy == "broadcast":  # independent samples: row y of every block at once
            for y in range(Y):
                res[:, y] = grad(o[:, y].sum())
            return res
        for b in range(B):  # whole-batch: coupled samples or forward-only strategies
            for y in range(Y):
                g = grad(o[b, y])
                res[b, y] = g if p.kind == "params" else g[b]
        return res
