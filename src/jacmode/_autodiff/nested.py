"""Generic path: nested forward mode (``torch.func.jvp`` inside ``torch.func.jvp``) for any f.

The mirror image of the Taylor fast path in ``_capture/taylor.py``: the same functions (``partial``,
``first``, ``pairs``, ``laplacian``) with the same shapes, for any callable ``fn`` mapping
z (B, D) to (B, Y) instead of a known stack of layers.

NOTE: [Nested forward mode]
One jvp with the tangent e_d on every sample differentiates every sample along coordinate d at
once (independent samples, see design.md), so the cost does not grow with B beyond the batched
pass. Differentiating k times nests k jvps; each level carries a primal and a tangent of the level
below, so order k costs about 2^k forward passes -- the price of knowing nothing about ``fn``.
Several directions (the D coordinates of a Laplacian, the pairs of a Hessian) are vectorised with
``vmap``. Some operations have no forward-mode rule for their derivative (``silu_backward``,
custom autograd Functions without ``jvp``); for those, ``reverse=True`` nests reverse mode
instead, as the hand-written ``torch.autograd.grad`` idiom does: each level pulls back one
cotangent e_y per output, shared by all samples, and keeps column d. For coupled samples,
``scale`` (B, 1) restricts every tangent to one sample (a one-hot column, vmapped over samples by
the caller), which gives the exact diagonal blocks.
Above first order (and under ``create_graph``) the caller runs these functions inside
``_rules.decompositions.exact()``: torch's own higher derivatives of layer_norm, det, solve and a
few more are wrong, so those ops are differentiated as decompositions into primitives.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.func import vjp, vmap

from .._threads import jvp  # one thread at a time: see [Threads] in _threads.py
Fn = Callable[[Tensor], Tensor]


def seeds(z: Tensor, dims: Sequence[int]) -> Tensor:
    """Rows e_d for d in dims, shape (k, 1, D), to broadcast over the samples of z (B, D)."""
    seed = z.new_zeros(len(dims), 1, z.shape[-1])
    seed[torch.arange(len(dims), device=z.device), 0, torch.as_tensor(list(dims), dtype=torch.long, device=z.device)] = 1
    return seed


def tangents(z: Tensor, dims: Sequence[int], scale: Optional[Tensor] = None) -> Tensor:
    """e_d on every sample (or only where ``scale`` is 1), for d in dims: shape (k, B, D)."""
    seed = seeds(z, dims).expand(len(dims), *z.shape)
    return seed if scale is None else seed * scale


def _along(g: Fn, d: int, scale: Optional[Tensor]) -> Fn:
    return lambda y: jvp(g, (y,), (tangents(y, (d,), scale)[0],))[1]


def _pulled(g: Fn, d: int, scale: Optional[Tensor]) -> Fn:
    def h(y: Tensor) -> Tensor:
        out, pull = vjp(g, y)[:2]
        cot = tangents(out, range(out.shape[-1]), scale)  # (Y, B, Y): e_y on every sample
        return vmap(lambda c: pull(c)[0][:, d])(cot).transpose(0, 1)

    return h


def partial(fn: Fn, z: Tensor, dims: Sequence[int], scale: Optional[Tensor] = None,
            reverse: bool = False) -> Tensor:
    """Per-sample mixed partial along ``dims``, one nested jvp (or vjp) per entry: (B, Y)."""
    g = fn
    for d in dims:
        g = _pulled(g, d, scale) if reverse else _along(g, d, scale)
    return g(z)


def partials(fn: Fn, z: Tensor, targets: Sequence[Sequence[int]], scale: Optional[Tensor] = None,
             reverse: bool = False) -> Tensor:
    """Several mixed partials, one nested jvp (or vjp) chain each: (K, B, Y)."""
    return torch.stack([partial(fn, z, dims, scale, reverse) for dims in targets])


def first(fn: Fn, z: Tensor, dims: Sequence[int], scale: Optional[Tensor] = None,
          reverse: bool = False) -> Tensor:
    """First derivatives along each d in ``dims``: (k, B, Y)."""
    if reverse:
        return torch.stack([partial(fn, z, (d,), scale, True) for d in dims])
    return vmap(lambda u: jvp(fn, (z,), (u,))[1], randomness="same")(tangents(z, dims, scale))


def pairs(fn: Fn, z: Tensor, ii: Sequence[int], jj: Sequence[int],
          scale: Optional[Tensor] = None, reverse: bool = False) -> Tensor:
    """Second derivatives d^2 f / dx_i dx_j for the pairs (ii[p], jj[p]): (P, B, Y)."""
    if reverse:
        return torch.stack([partial(fn, z, (i, j), scale, True) for i, j in zip(ii, jj)])

    def second(u: Tensor, v: Tensor) -> Tensor:
        return jvp(lambda y: jvp(fn, (y,), (v,))[1], (z,), (u,))[1]

    return vmap(second, randomness="same")(tangents(z, ii, scale), tangents(z, jj, scale))


def laplacian(fn: Fn, z: Tensor, dims: Sequence[int], scale: Optional[Tensor] = None,
              reverse: bool = False) -> Tensor:
    """Sum over d in ``dims`` of d^2 f / dx_d^2: (B, Y)."""
    return pairs(fn, z, dims, dims, scale, reverse).sum(0)


def rows(fn: Fn, z: Tensor, dims: Sequence[int], scale: Optional[Tensor] = None,
         reverse: bool = False) -> Tensor:
    """Rows d (for d in ``dims``) of every output's per-sample Hessian, forward over reverse:
    (k, D, B, Y), entry [i, e, b, y] = d^2 f_y / dx_(dims[i]) dx_e at sample b.

    One vjp per output with the cotangent e_y on every sample gives each sample's gradient of f_y
    (the gradient of the sum over independent samples; with ``scale`` the cotangent sits on one
    sample only, so coupled samples get their own block); a jvp of those gradients along e_d gives
    row d. ``reverse``: a second vjp with the cotangent e_d per output instead of the jvp, for
    operations without a forward-mode rule.
    """
    def grads(y: Tensor) -> Tensor:  # (Y, B, D)
        out, pull = vjp(fn, y)[:2]
        cot = tangents(out, range(out.shape[-1]), scale)  # (Y, B, Y)
        return vmap(lambda c: pull(c)[0])(cot)

    k, (batch, n) = len(dims), z.shape
    if not reverse:
        r = vmap(lambda u: jvp(grads, (z,), (u,))[1], randomness="same")(tangents(z, dims, scale))
        return r.permute(0, 3, 2, 1)  # (k, Y, B, D) -> (k, D, B, Y)
    g, pull2 = vjp(grads, z)[:2]
    n_out = g.shape[0]
    cot = z.new_zeros(k, n_out, n_out, 1, n)
    ks, ys = torch.meshgrid(torch.arange(k, device=z.device), torch.arange(n_out, device=z.device), indexing="ij")
    cot[ks, ys, ys, 0, torch.as_tensor(list(dims), dtype=torch.long, device=z.device)[ks]] = 1
    cot = cot.expand(k, n_out, n_out, batch, n)
    if scale is not None:
        cot = cot * scale
    r = vmap(lambda c: pull2(c)[0])(cot.reshape(k * n_out, n_out, batch, n))  # (k Y, B, D)
    return r.reshape(k, n_out, batch, n).permute(0, 3, 2, 1)
