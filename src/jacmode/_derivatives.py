"""Derivative operators for physics-informed training, per sample and differentiable.

Each operator validates its arguments, builds the :class:`~jacmode._operands.Target` (which picks
Taylor mode for a known ``nn.Sequential`` and nested forward mode otherwise, see ``_operands.py``)
and assembles the user-facing shape.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _operators
from ._cache import WeakCache
from ._checks import Options
from ._engines import traceable as _traceable  # inside a user's torch.compile (see its note)
from ._operands import (
    SUM_PASS_BYTES,
    Target,
    check_dims,
    direction_chunks,
    evaluate,
    validated,
)
from ._state import preserved_state

Fn = Callable[[Tensor], Tensor]


def derivative(
    f: Fn,
    t: Tensor,
    order: int = 1,
    *,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Tensor:
    """Per-sample derivative d^k y / dt^k for one scalar input per sample.

    Taylor mode (k + 1 coefficients, about k + 1 passes) for an ``nn.Sequential`` of ``nn.Linear``
    and known activations (Tanh, Sigmoid, SiLU, Softplus, ReLU, LeakyReLU, GELU); nested forward
    mode (about 2^k passes) for any other f. The cost does not grow with B beyond the batched pass.

    Args:
        f: maps t of shape (B,) or (B, 1) to (B, *out).
        t: one scalar per sample, shape (B,) or (B, 1). When f only accepts (B, 1) (a first layer
            ``nn.Linear(1, H)``), t of shape (B,) is passed as the column t[:, None].
        order: k >= 1, the order of the derivative.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B, *out): d^k f(t)[b] / dt_b^k.

    Example:
        >>> import torch, jacmode as jm
        >>> t = torch.linspace(0, 1, 5)
        >>> jm.derivative(lambda t: t ** 3, t)     # 3 t^2
        tensor([0.0000, 0.1875, 0.7500, 1.6875, 3.0000])
        >>> jm.derivative(lambda t: t ** 3, t, order=2)     # 6 t
        tensor([0.0000, 1.5000, 3.0000, 4.5000, 6.0000])
    """
    opts = validated(f, t, "t", structure, chunk_size, create_graph)
    if not (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)):
        raise ValueError(
            f"t: expected one scalar per sample, shape (B,) or (B, 1), got {tuple(t.shape)}. "
            "For several input coordinates use jacmode.partial or jacmode.jacobian."
        )
    if isinstance(order, bool) or not isinstance(order, int):
        raise TypeError(f"order: expected a positive int, got {type(order).__name__} ({order!r}).")
    if order < 1:
        raise ValueError(f"order: expected a positive int, got {order}. Use 1 for dy/dt, 2 for d2y/dt2, ...")
    if torch.compiler.is_compiling():  # compile: a traceable path
        return _traceable.derivative(lambda: derivative(f, t, order, structure=structure, chunk_size=chunk_size,
                                                        create_graph=create_graph),
                                     f, t, order, opts.structure, opts.create_graph)
    if t.dim() == 1 and t.shape[0] > 0 and _needs_column(f, t):
        t = t.unsqueeze(1)
    return _partial(f, t, (0,) * order, opts)


_COLUMN = WeakCache("scalar inputs as a column")


def _needs_column(f: Fn, t: Tensor) -> bool:
    """True when f rejects t of shape (B,) but accepts (B, 1) (a model whose first layer is
    Linear(1, H), like problem 2's); a ValueError naming t and the fix when it accepts neither."""
    key = (t.dtype, t.device.type)
    known = _COLUMN.get(f, key)
    if known is not None:
        return bool(known)
    sample = t[:1].detach().expand(2).clone()  # two samples: Linear(1, H) takes one (1,) as unbatched
    with torch.no_grad(), preserved_state(f):
        try:
            out = f(sample)
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != 2:
                raise ValueError(f"f(t) does not keep the batch dimension (got {type(out).__name__})")
            verdict = False
        except Exception as err:  # noqa: BLE001 -- f's own error, reported below if (B, 1) fails too
            try:
                f(sample.unsqueeze(1))
            except Exception:  # noqa: BLE001
                raise ValueError(
                    f"t: f fails on t of shape (B,) = {tuple(t.shape)} ({type(err).__name__}: {err}) and on "
                    f"t.unsqueeze(1) of shape {(t.shape[0], 1)}. Pass t in the shape f expects: one "
                    "scalar per sample, (B,) or (B, 1)."
                ) from err
            verdict = True
    _COLUMN.put(f, key, verdict)
    return verdict


def partial(
    f: Fn,
    x: Tensor,
    dims: Sequence[int],
    *,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Tensor:
    """Per-sample mixed partial derivative of any order along input coordinates ``dims``.

    For x = (t, x1, x2) per sample: ``dims=(0,)`` is u_t, ``(1, 1)`` is u_x1x1, ``(1, 2)`` is
    u_x1x2, ``(0, 1, 1)`` is u_tx1x1. Same engines as :func:`derivative`.

    Args:
        f: maps x of shape (B, D) (or (B, *in), coordinates counted flat) to (B, *out).
        x: the batch of points, shape (B, D).
        dims: the coordinates to differentiate along, one entry per order (negative ones count
            from the end).
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B, *out).

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.], [3., 1.]])
        >>> u = lambda x: x[:, :1] ** 2 * x[:, 1:] ** 3      # u = x0^2 x1^3, shape (B, 1)
        >>> jm.partial(u, x, (0, 1))                          # 6 x0 x1^2
        tensor([[24.],
                [18.]])
    """
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    if torch.compiler.is_compiling():  # compile: a traceable path
        again = lambda: (partial(f, x, dims, structure=structure, chunk_size=chunk_size,  # noqa: E731
                                 create_graph=create_graph),)
        return _traceable.partials(again, f, x, [check_dims(dims, math.prod(x.shape[1:]))], opts.structure,
                                   opts.create_graph)[0]
    return _partial(f, x, check_dims(dims, math.prod(x.shape[1:])), opts)


def _partial(f: Fn, x: Tensor, dims: tuple[int, ...], opts: Options) -> Tensor:
    def body(t: Target) -> Tensor:
        flat = t.over_samples(opts.chunk_size, (), lambda z, s: t.run("partial", z, dims, scale=s))
        return flat.reshape(x.shape[0], *t.out_shape)

    return evaluate(f, x, opts, body)


def partials(
    f: Fn,
    x: Tensor,
    dims: Sequence[Sequence[int]],
    *,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> tuple[Tensor, ...]:
    """Several per-sample mixed partials of the same samples, from one shared propagation.

    A PINN residual such as u_t - nu * u_xx needs u_t and u_xx at the same points: on the Taylor
    path one pass carries the coefficients of every sub-multiset they need (u_x serves both u_x
    and u_xx), instead of one pass per partial. Each result is what :func:`partial` returns.

    Args:
        f: maps x of shape (B, D) (or (B, *in), coordinates counted flat) to (B, *out).
        x: the batch of points, shape (B, D).
        dims: one tuple of coordinates per partial, e.g. ``[(0,), (1, 1)]`` for u_t and u_xx.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the results differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        A tuple with one tensor of shape (B, *out) per entry of ``dims``, in the order given.

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.], [3., 1.]])
        >>> u = lambda x: x[:, :1] ** 2 * x[:, 1:] ** 3      # u = x0^2 x1^3, shape (B, 1)
        >>> u_0, u_11 = jm.partials(u, x, [(0,), (1, 1)])    # 2 x0 x1^3, 6 x0^2 x1
        >>> torch.cat([u_0, u_11], 1)
        tensor([[16., 12.],
                [ 6., 54.]])
    """
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or any(isinstance(d, int) for d in dims):
        raise TypeError(
            f"dims: expected a list of coordinate tuples, one per partial, e.g. [(0,), (1, 1)] for "
            f"u_t and u_xx, got {dims!r}. For a single partial use jacmode.partial.")
    if not dims:
        raise ValueError("dims: expected at least one partial, e.g. [(0,), (1, 1)], got an empty list.")
    n = math.prod(x.shape[1:])
    targets = [check_dims(d, n) for d in dims]
    if torch.compiler.is_compiling():  # compile: a traceable path
        return _traceable.partials(lambda: partials(f, x, dims, structure=structure, chunk_size=chunk_size,
                                                    create_graph=create_graph),
                                   f, x, targets, opts.structure, opts.create_graph)

    def body(t: Target) -> tuple[Tensor, ...]:
        flat = t.over_samples(opts.chunk_size, (len(targets),),
                              lambda z, s: t.run("partials", z, targets, scale=s))
        return tuple(r.reshape(x.shape[0], *t.out_shape) for r in flat.unbind(0))

    return evaluate(f, x, opts, body)


def hessian(
    f: Fn,
    x: Tensor,
    *,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Tensor:
    """Per-sample Hessian of every output with respect to the sample's input.

    Computes the D (D + 1) / 2 distinct second derivatives (Taylor mode or nested forward mode,
    vectorised over the pairs) and mirrors them.

    Args:
        f: maps x of shape (B, D) (or (B, *in)) to (B, *out).
        x: the batch of points.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work);
            "sparse": x is one point and f scalar, the (N, N) sparse CSR Hessian from one
            Hessian-vector product per star colour (see :func:`jacmode.sparse_hessian`).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B, *out, D, D) (or (B, *out, *in, *in)); (N, N) sparse for structure="sparse".

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.]])
        >>> jm.hessian(lambda x: x[:, :1] ** 2 * x[:, 1:], x)     # u = x0^2 x1
        tensor([[[[4., 2.],
                  [2., 0.]]]])
    """
    if structure == "sparse":
        from ._sparse.api import sparse_hessian

        return sparse_hessian(f, x, chunk_size=chunk_size, create_graph=create_graph)
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    def body(t: Target) -> Tensor:
        n = math.prod(t.in_shape)
        ii, jj = torch.triu_indices(n, n).tolist()
        chunks, width = direction_chunks(t, len(ii), opts.chunk_size)
        pairs = [(ii[c.start : c.stop], jj[c.start : c.stop]) for c in chunks]
        blocks = [t.over_samples(width, (len(a),), lambda z, s: t.run("pairs", z, a, b, scale=s))
                  for a, b in pairs]
        vals = torch.cat(blocks) if blocks else t.z.new_zeros(0, x.shape[0], math.prod(t.out_shape))
        where = torch.zeros(n, n, dtype=torch.long, device=vals.device)
        where[ii, jj] = where[jj, ii] = torch.arange(len(ii), device=vals.device)
        full = vals[where].permute(2, 3, 0, 1)  # (B, Y, N, N)
        return full.reshape(x.shape[0], *t.out_shape, *t.in_shape, *t.in_shape)

    return evaluate(f, x, opts, body)


def laplacian(
    f: Fn,
    x: Tensor,
    *,
    weight: Optional[Tensor] = None,
    samples: Optional[int] = None,
    distribution: str = "rademacher",
    generator: Optional[torch.Generator] = None,
    return_std: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Per-sample Laplacian (trace of the Hessian) of every output, without forming the Hessian.

    For a captured model the forward Laplacian carries the value, the D first derivatives and
    their running Laplacian through the layers (about D + 2 passes); otherwise D nested jvps along
    the coordinates, vectorised. With ``weight=S`` it is the weighted Laplacian tr(S S^T Hess f),
    one direction per column of S; with ``samples=K`` an unbiased estimate from K random
    directions per sample (Hutchinson; see the note in ``_operators.py``), which costs K instead
    of D directions.

    Args:
        f: maps x of shape (B, D) (or (B, *in)) to (B, *out).
        x: the batch of points.
        weight: None, or S of shape (D, R) or per sample (B, D, R): the diffusion C = S S^T.
        samples: None for the exact value, else the number K of random directions per sample.
        distribution: law of the random directions, "rademacher" (lower variance) or "gaussian".
        generator: a ``torch.Generator`` for reproducible draws.
        return_std: also return the standard error of the estimate (needs samples >= 2).
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B, *out): the sum over d of d^2 f / dx_d^2 (of C_ij d^2 f / dx_i dx_j with a
        weight); with ``return_std`` a pair (estimate, standard error), both (B, *out).

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2., 3.]])
        >>> jm.laplacian(lambda x: (x ** 3).sum(1), x)     # 6 (x0 + x1 + x2)
        tensor([36.])
        >>> jm.laplacian(lambda x: (x ** 3).sum(1), x, weight=torch.eye(3)[:, :1])  # C = e0 e0^T
        tensor([6.])
    """
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    if torch.compiler.is_compiling():  # compile: a traceable path
        def again() -> Union[Tensor, tuple[Tensor, Tensor]]:
            return laplacian(f, x, weight=weight, samples=samples, distribution=distribution, generator=generator,
                             return_std=return_std, structure=structure, chunk_size=chunk_size,
                             create_graph=create_graph)

        if samples is not None or return_std:
            return _traceable.eager("samples", again)
        return _traceable.laplacian(again, f, x, weight, opts.structure, opts.create_graph)
    if weight is not None or samples is not None or return_std:
        return _operators.weighted_laplacian(f, x, opts, weight, samples, distribution, generator, return_std)
    def body(t: Target) -> Tensor:
        total = _sum_over_coordinates(
            t, opts, lambda c, width: t.over_samples(width, (), lambda z, s: t.run("laplacian", z, c, scale=s)),
            t.z.new_zeros(x.shape[0], math.prod(t.out_shape)))
        return total.reshape(x.shape[0], *t.out_shape)

    return evaluate(f, x, opts, body)


def divergence(
    f: Fn,
    x: Tensor,
    *,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Tensor:
    """Per-sample divergence of a vector field f: (B, D) -> (B, D).

    Args:
        f: maps x of shape (B, D) (or (B, *in)) to an output of the same shape.
        x: the batch of points.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B,): the sum over d of d f_d / dx_d.

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.], [3., 4.]])
        >>> jm.divergence(lambda x: x ** 2, x)      # 2 (x0 + x1)
        tensor([ 6., 14.])
    """
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    def body(t: Target) -> Tensor:
        if t.out_shape != t.in_shape:
            raise ValueError(
                f"f: divergence needs a vector field whose output has the shape of its input, but "
                f"each sample maps {t.in_shape} to {t.out_shape}. Return one component per input "
                "coordinate, or use jacmode.jacobian for other shapes."
            )

        def trace(c: range, width: Optional[int]) -> Tensor:
            jac = t.over_samples(width, (len(c),), lambda z, s: t.run("first", z, c, scale=s))
            k = torch.arange(len(c), device=jac.device)
            return jac[k, :, torch.as_tensor(c, device=jac.device)].sum(0)  # (B,)

        return _sum_over_coordinates(t, opts, trace, x.new_zeros(x.shape[0]))

    return evaluate(f, x, opts, body)


def _sum_over_coordinates(t: Target, opts: Options, term: Callable[[range, Optional[int]], Tensor], empty: Tensor) -> Tensor:
    """Sum ``term(chunk, width)`` over the chunks of the D coordinate directions (laplacian, divergence)."""
    chunks, width = direction_chunks(t, math.prod(t.in_shape), opts.chunk_size, SUM_PASS_BYTES)
    parts = [term(c, width) for c in chunks]
    return sum(parts[1:], parts[0]) if parts else empty
