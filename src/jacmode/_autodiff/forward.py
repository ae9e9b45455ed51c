"""Forward engine: push chunks of tangents through ``fn`` with ``vmap(jvp)``.

NOTE: [Forward and reverse engines]
``forward_columns`` and ``reverse_rows`` (in ``_autodiff/reverse.py``) are mirror images with the same
signature: a pure function ``fn`` of one tensor ``primal``, ``n`` directions, a ``seeds(start, stop)``
callback that builds the chunk of tangents (or cotangents) with a leading direction dimension, and a
``place(start, stop, block)`` callback that writes the chunk's Jacobian-vector products into the
result. What the directions mean (broadcast over independent samples, one-hot over the whole batch,
a single vector of ones for elementwise maps) is decided in ``_structure.py``; the engines only
differentiate. A chunk of one direction uses dual tensors directly, which skips ``vmap`` and is the
fastest way to run a single jvp; not under ``torch.inference_mode()``, where ``make_dual`` silently
drops the tangent (the output's tangent is None, which would read as "does not depend on the
input"), while ``torch.func.jvp`` still differentiates; and not inside torch.func transforms,
where a ``dual_level`` under an outer ``jvp`` / ``jacfwd`` raises "Nested forward mode AD is not
supported", while ``torch.func.jvp`` nests; nor when the result keeps a graph (``create_graph``):
torch's dual-tensor softmax modifies its exp output in place, which breaks the backward pass of
that graph ("modified by an inplace operation"; found by the differential harness).

NOTE: [Forward mode and threads]
PyTorch keeps the forward-AD level (``torch.autograd.forward_ad``) and the jvp nesting depth of
``torch.func.jvp`` in process-wide Python globals, so two threads running jvps at once fail
("Nested forward mode AD is not supported", "invalid forward AD level"). ``pushforward``
therefore holds a process-wide re-entrant lock: forward-mode passes of different threads take
turns, reverse mode is unaffected.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.func import vmap

from .._state import RngReplay
from .._threads import SERIAL, dual_level, jvp
from .._transforms import in_transform
from .._capture import codegen as _codegen
from .._capture.capture import Program
from .reverse import Place, Seeds, chunks

def pushforward(fn: Callable[[Tensor], Tensor], primal: Tensor, tangents: Tensor) -> Tensor:
    """Jacobian-vector products of ``fn`` at ``primal`` for a stack of tangents.

    Args:
        fn: a function of one tensor.
        primal: the point, shape S.
        tangents: shape (K, *S).

    Returns:
        Shape (K, *fn(primal).shape).
    """
    with SERIAL:  # see the note on threads above
        single = (tangents.shape[0] == 1 and not torch.is_inference_mode_enabled() and not in_transform()
                  and not torch.is_grad_enabled())
        if single:  # see the note above
            with dual_level():
                out = fn(fwAD.make_dual(primal, tangents[0]))
                tangent = fwAD.unpack_dual(out).tangent
            if tangent is None:  # the output does not depend on the input
                tangent = torch.zeros_like(out)
            return tangent.unsqueeze(0)
        return vmap(lambda t: jvp(fn, (primal,), (t,))[1], randomness="same")(tangents)


def forward_columns(
    fn: Callable[[Tensor], Tensor],
    primal: Tensor,
    n: int,
    seeds: Seeds,
    place: Place,
    chunk_size: int,
    rng: RngReplay | None = None,
) -> None:
    """Push ``n`` tangent directions through ``fn`` in chunks of ``chunk_size``.

    Every chunk re-runs the forward pass; when ``rng`` is given the random number generator is
    reset before each chunk, so random layers (dropout in training mode) draw the same masks for
    every direction.
    """
    for start, stop in chunks(n, chunk_size):
        if rng is not None:
            rng.reset()
        place(start, stop, pushforward(fn, primal, seeds(start, stop)))


def layerwise_columns(
    program: Program, in_shape: tuple[int, ...], primal: Tensor, n: int, place: Place, chunk_size: int
) -> None:
    """Forward mode over a captured graph (``_capture/capture.py``) whose operations all have rules.

    The tangents e_d, shared by all samples, are pushed op by op with plain torch operations
    (``taylor.first``, as generated code from the third call and compiled under ``compile=True``:
    ``_capture/codegen.py``): no dual tensors, no vmap, and the first layer's product W e_d stays
    one row broadcast over the batch. Same contract as ``forward_columns`` with broadcast seeds, for
    ``primal`` of shape (B, D); the products placed have shape (k, B, Y).
    """
    for start, stop in chunks(n, chunk_size):
        place(start, stop, _codegen.run("first", program, primal, in_shape, range(start, stop)))
