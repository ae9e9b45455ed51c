"""Reverse engine: pull chunks of cotangents back through ``fn`` with ``vmap(vjp)``.

The mirror image of ``_autodiff/forward.py`` (see the note there): same signature, with the one forward
pass and its tape shared by all chunks. ``per_sample_rows`` adds the outer ``vmap`` over samples
that parameter Jacobians need, since parameters are shared by all samples.

NOTE: [Grad mode of the reverse engines]
``torch.func.vjp`` runs the kernels at the bottom of its stack under the *caller's* grad mode, and
some kernels read it to decide whether to keep what their own backward needs: the mkldnn CPU kernel
of ``nn.LSTM`` / ``nn.GRU`` in float32 keeps no workspace under ``torch.no_grad()``, and its backward
then raises torch's "Expected a proper Tensor but got None ... workspace". So the engines pull back
under ``torch.enable_grad()`` (``recording``) and detach the blocks when the caller's mode was off
(``create_graph=False``), so nothing outside the engine holds on to a tape. Under
``torch.inference_mode()`` grad mode stays off (functorch would try to save inference tensors)
and the engines take torch's native CPU kernels instead (``_state.without_mkldnn``). The
capability probes (``fallback.capabilities``) run under the same modes as the engines.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch.func import vjp, vmap

from .._state import RngReplay, without_mkldnn

Seeds = Callable[[int, int], Tensor]
Place = Callable[[int, int, Tensor], None]


def chunks(n: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """The blocks ``(start, stop)`` of ``n`` directions, ``chunk_size`` at a time (the last one shorter)."""
    for start in range(0, n, chunk_size):
        yield start, min(n, start + chunk_size)


@contextlib.contextmanager
def recording() -> Iterator[Callable[[Tensor], Tensor]]:
    """Grad mode on for a vjp engine; yields what to apply to its products (see the note)."""
    if torch.is_inference_mode_enabled():  # grad mode on would save inference tensors for backward
        with without_mkldnn():
            yield lambda t: t
        return
    keep = torch.is_grad_enabled()
    with torch.enable_grad():
        yield (lambda t: t) if keep else Tensor.detach


def pullback(vjp_fn: Callable[[Tensor], tuple[Tensor, ...]], cotangents: Tensor) -> Tensor:
    """Vector-Jacobian products for a stack of cotangents of shape (K, *out); returns (K, *S)."""
    if cotangents.shape[0] == 1:
        return vjp_fn(cotangents[0])[0].unsqueeze(0)
    return vmap(lambda c: vjp_fn(c)[0])(cotangents)


def reverse_rows(
    fn: Callable[[Tensor], Tensor],
    primal: Tensor,
    n: int,
    seeds: Seeds,
    place: Place,
    chunk_size: int,
    rng: RngReplay | None = None,
) -> None:
    """Pull ``n`` cotangent directions back through ``fn`` in chunks of ``chunk_size``.

    One forward pass records the tape; every chunk reuses it, so random layers draw one mask
    (``rng`` is accepted for symmetry with the forward engine).
    """
    with recording() as out:
        vjp_fn = vjp(fn, primal)[1]
        for start, stop in chunks(n, chunk_size):
            place(start, stop, out(pullback(vjp_fn, seeds(start, stop))))


def per_sample_rows(
    fn: Callable[[Tensor, Tensor], Tensor],
    primal: Tensor,
    data: Tensor,
    n_out: int,
    place: Callable[[int, int, int, int, Tensor], None],
    sample_chunk: int,
    direction_chunk: int,
    rng: RngReplay | None = None,
) -> None:
    """Per-sample reverse Jacobians of ``fn(primal, sample)`` with a shared ``primal``.

    Args:
        fn: ``(primal, one sample without batch dim) -> output`` of ``n_out`` elements.
        primal: shared point (the flat parameters), shape (P,).
        data: the samples, shape (B, *in).
        n_out: Y, the number of output elements per sample.
        place: ``place(b0, b1, y0, y1, block)`` with block of shape (b1-b0, y1-y0, P).
        sample_chunk: samples per vectorised pass.
        direction_chunk: output directions per vectorised pass.
        rng: when given, reset before each chunk of directions of the same samples, so that
            random layers draw one mask per sample, shared by all its output directions.
    """
    eye = torch.eye(n_out, dtype=primal.dtype, device=primal.device)

    def rows(sample: Tensor, cotangents: Tensor) -> Tensor:
        vjp_fn = vjp(lambda z: fn(z, sample).reshape(-1), primal)[1]
        return pullback(vjp_fn, cotangents)

    batched_rows = vmap(rows, in_dims=(0, None), randomness="different")
    with recording() as out:
        for b0 in range(0, data.shape[0], sample_chunk):
            b1 = min(data.shape[0], b0 + sample_chunk)
            replay = RngReplay(primal.device) if rng is not None else None
            for y0 in range(0, n_out, direction_chunk):
                y1 = min(n_out, y0 + direction_chunk)
                if replay is not None:
                    replay.reset()
                place(b0, b1, y0, y1, out(batched_rows(data[b0:b1], eye[y0:y1])))


def sample_rows(
    fn: Callable[[Tensor], Tensor],
    primal: Tensor,
    n: int,
    place: Place,
    chunk_size: int,
) -> None:
    """Reverse rows of independent samples, vmapped over the samples: ``vmap(vjp)`` per sample.

    Args:
        fn: one sample (D,) -> (Y,), Y = ``n``.
        primal: the samples, (B, D).
        place: ``place(start, stop, block)`` with block (B, stop - start, D): rows start..stop-1 of
            every sample's block, already in the layout of the result (B, Y, D). The broadcast
            engine (``reverse_rows`` with cotangents e_y shared by all samples) gives them as
            (k, B, D), and the copy into (B, Y, D) costs as much as the products (a (B*Y, D)
            transpose of the whole result, 1.4x torch.func's ``vmap(jacrev)`` at B = 1024).
    """
    eye = torch.eye(n, dtype=primal.dtype, device=primal.device)

    def rows(zb: Tensor, cotangents: Tensor) -> Tensor:
        return pullback(vjp(fn, zb)[1], cotangents)

    batched = vmap(rows, in_dims=(0, None))
    with recording() as out:
        for start, stop in chunks(n, chunk_size):
            place(start, stop, out(batched(primal, eye[start:stop])))
