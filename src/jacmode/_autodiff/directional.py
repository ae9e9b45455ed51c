"""Generic path of the linear differential operators: nested forward mode along given vectors.

The mirror image of ``collapsed.py`` for any callable ``fn`` mapping z (B, N) to (B, Y): each
term D^k fn[t_1, ..., t_k] is k nested ``jvp`` with the tangents t_i (1 | B, N) (about 2^k passes),
the terms of one order vectorised with ``vmap``. Exact for any f that forward mode differentiates;
nothing is collapsed, since nothing is known about fn. For coupled samples ``scale`` (B, 1)
restricts every tangent to one sample, as in ``nested.py``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch import Tensor
from torch.func import vmap

from .._threads import jvp  # one thread at a time: see [Threads] in _threads.py
Fn = Callable[[Tensor], Tensor]


def mixed(fn: Fn, z: Tensor, tangents: Sequence[Tensor], scale: Optional[Tensor] = None) -> Tensor:
    """D^k fn(z)[t_1, ..., t_k] for tangents (1 | B, N): (B, Y); fn(z) itself for k = 0."""
    g = fn
    for t in tangents:
        tangent = t if scale is None else t * scale

        def along(y: Tensor, g: Fn = g, tangent: Tensor = tangent) -> Tensor:
            return jvp(g, (y,), (tangent.expand_as(y),))[1]

        g = along
    return g(z)


def terms(fn: Fn, z: Tensor, stacks: Sequence[Tensor], scale: Optional[Tensor] = None) -> list[Tensor]:
    """For each stack (T, k, 1 | B, N) of T terms of order k: their values (T, B, Y)."""
    out = []
    for stack in stacks:
        if stack.shape[1] == 0:
            out.append(fn(z).unsqueeze(0).expand(stack.shape[0], -1, -1))
        else:
            out.append(vmap(lambda ts: mixed(fn, z, ts.unbind(0), scale), randomness="same")(stack))
    return out


def second(fn: Fn, z: Tensor, vectors: Tensor, weights: Optional[Tensor] = None, per_direction: bool = False,
           scale: Optional[Tensor] = None) -> Tensor:
    """sum_l w_l D^2 fn[v_l, v_l] (B, Y), or each term (L, B, Y) with ``per_direction``."""
    each = directional(fn, z, vectors, 2, scale)
    if weights is not None:
        each = each * weights[..., None]
    return each if per_direction else each.sum(0)


def directional(fn: Fn, z: Tensor, vectors: Tensor, order: int, scale: Optional[Tensor] = None) -> Tensor:
    """D^k fn[v_l, ..., v_l] for each of the L directions (L, 1 | B, N): (L, B, Y)."""
    return vmap(lambda v: mixed(fn, z, [v] * order, scale), randomness="same")(vectors)


