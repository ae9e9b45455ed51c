"""Derivative operators for physics-informed training, per sample and differentiable.

Each operator validates its arguments (``_checks``), describes the problem (``_problem.describe``,
which runs the coupling probe of ``_coupling``), then differentiates with one of two engines that
have the same functions and shapes: ``_taylor`` (Taylor mode, for an ``nn.Sequential`` of
``nn.Linear`` and known activations) or ``_nested`` (nested forward mode, for any callable).
Such a stack treats every sample on its own and has no state, so the fast path skips the probe
and the state guard (a PINN calls these operators thousands of times on small batches, where that
overhead would show).

NOTE: [Chunks of the derivative operators]
``chunk_size`` bounds the width of one vectorised pass, as in :func:`jacmode.jacobian`. laplacian
and divergence vectorise the D coordinate directions, hessian the D (D + 1) / 2 pairs of them, so
there it counts directions (pairs); derivative and partial push a single direction shared by all
samples, so there it counts samples. With ``structure="coupled"`` every sample needs tangents of its
own (vmapped over samples, B times the work), and chunk_size counts samples x directions.
"""

from __future__ import annotations

import contextlib
import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import vmap

from . import _checks, _nested, _taylor
from ._checks import Options
from ._jacobian import _options
from ._problem import describe
from ._state import RngReplay, preserved_state
from ._structure import one_hot

Fn = Callable[[Tensor], Tensor]
_NO_FORWARD_AD: "weakref.WeakSet[Any]" = weakref.WeakSet()  # functions that need reverse mode
@dataclass
class _Target:
    """The function to differentiate in flat form, and the engine that will do it."""

    key: Any  # the user's f: remembers that it needs reverse mode
    fn: Fn  # z (b, N) -> (b, Y), for any number b of samples
    z: Tensor  # (B, N)
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    layers: Optional[list[nn.Module]]  # the Taylor fast path applies when not None
    coupled: bool
    rng: Optional[RngReplay]

    def run(self, name: str, z: Tensor, *args: Any, scale: Optional[Tensor] = None) -> Tensor:
        if self.layers is not None:
            return getattr(_taylor, name)(self.layers, z, *args)
        engine = getattr(_nested, name)
        if self.key not in _NO_FORWARD_AD:
            try:
                return engine(self.fn, z, *args, scale)
            except NotImplementedError as err:  # an op without a forward-mode rule: see _nested
                if "forward" not in str(err).lower() and "jvp" not in str(err).lower():
                    raise
                with contextlib.suppress(TypeError):
                    _NO_FORWARD_AD.add(self.key)
        return engine(self.fn, z, *args, scale, reverse=True)

    def over_samples(self, width: Optional[int], lead: tuple[int, ...],
                     compute: Callable[[Tensor, Optional[Tensor]], Tensor]) -> Tensor:
        """``compute(z, scale) -> (*lead, b, Y)`` for all samples, ``width`` samples at a time."""
        batch, n_out = self.z.shape[0], math.prod(self.out_shape)
        if batch == 0 or n_out == 0:
            return self.z.new_zeros(*lead, batch, n_out)
        width = batch if width is None else width
        if self.rng is not None:
            self.rng.reset()
        if not self.coupled:
            if width >= batch:
                return compute(self.z, None)
            return torch.cat([compute(self.z[s : s + width], None) for s in range(0, batch, width)], -2)
        blocks = []
        for s in range(0, batch, width):
            e = min(batch, s + width)
            out = vmap(lambda m: compute(self.z, m), randomness="same")(one_hot(s, e, batch, self.z)[..., None])
            k = torch.arange(e - s, device=out.device)
            blocks.append(out.movedim(-2, 1)[k, s + k].movedim(0, -2))  # (*lead, e - s, Y)
        return torch.cat(blocks, -2)


def _validated(f: Any, x: Any, name: str, structure: Any, chunk_size: Any, create_graph: Any) -> Options:
    _checks.check_input(x, wrt="inputs", batched=True, name=name)
    opts = _options(f, x, wrt="inputs", mode="forward", batched=True, structure=structure,
                    chunk_size=chunk_size, create_graph=create_graph, flatten=True)
    if opts.structure == "diagonal":
        raise ValueError(
            "structure: 'diagonal' does not apply to the derivative operators. Use 'auto' (the "
            "default), 'independent' or 'coupled'; for elementwise f pass x of shape (B,) "
            "and use jacmode.derivative."
        )
    return opts


@contextlib.contextmanager
def _target(f: Fn, x: Tensor, opts: Options) -> Iterator[_Target]:
    grad_mode = torch.enable_grad() if opts.create_graph else torch.no_grad()
    in_shape = tuple(x.shape[1:])
    layers = _taylor.layers_of(f, in_shape)
    if layers is not None:  # independent samples and no state by construction: no probe needed
        with grad_mode:
            z = x if opts.create_graph else x.detach()
            yield _Target(key=f, fn=f, z=z, in_shape=in_shape, layers=layers, coupled=False, rng=None,
                          out_shape=(_taylor.out_features(layers, in_shape[0]),))
        return
    with preserved_state(f), grad_mode:
        p = describe(f, x, opts)
        n_out = p.n_out
        fn = lambda z: f(z.reshape(z.shape[0], *in_shape)).reshape(z.shape[0], n_out)  # noqa: E731
        yield _Target(key=f, fn=fn, z=p.z, in_shape=in_shape, out_shape=p.out_shape, layers=None,
                      coupled=p.structure == "coupled", rng=RngReplay(p.device) if p.random else None)


def _direction_chunks(t: _Target, n: int, chunk_size: Optional[int]) -> tuple[list[range], Optional[int]]:
    """Chunks of the n directions, and samples per pass (see the note on chunks)."""
    if t.coupled:
        return [range(n)], None if chunk_size is None else max(1, chunk_size // max(n, 1))
    step = max(1, chunk_size or n)
    return [range(s, min(n, s + step)) for s in range(0, n, step)], None


def _check_dims(dims: Any, n: int) -> tuple[int, ...]:
    items = (dims,) if isinstance(dims, int) and not isinstance(dims, bool) else dims
    try:
        if isinstance(items, (str, bytes)) or any(isinstance(d, bool) for d in items):
            raise TypeError
        items = tuple(operator.index(d) for d in items)
    except TypeError:
        raise TypeError(
            f"dims: expected a tuple of input coordinates, e.g. (0,) for u_t or (1, 1) for u_xx, "
            f"got {type(dims).__name__} ({dims!r})."
        ) from None
    if not items:
        raise ValueError("dims: expected at least one coordinate to differentiate along, got ().")
    bad = [d for d in items if not -n <= d < n]
    if bad:
        raise ValueError(
            f"dims: coordinate {bad[0]} is out of range: each sample of x has D = {n} "
            f"coordinate(s), so dims must lie in 0..{n - 1} (or -{n}..-1)."
        )
    return tuple(d % n for d in items)


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
        t: one scalar per sample, shape (B,) or (B, 1).
        order: k >= 1, the order of the derivative.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_derivatives.py``).
        create_graph: keep the result differentiable with respect to parameters and input.

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
    opts = _validated(f, t, "t", structure, chunk_size, create_graph)
    if not (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)):
        raise ValueError(
            f"t: expected one scalar per sample, shape (B,) or (B, 1), got {tuple(t.shape)}. "
            "For several input coordinates use jacmode.partial or jacmode.jacobian."
        )
    if isinstance(order, bool) or not isinstance(order, int):
        raise TypeError(f"order: expected a positive int, got {type(order).__name__} ({order!r}).")
    if order < 1:
        raise ValueError(f"order: expected a positive int, got {order}. Use 1 for dy/dt, 2 for d2y/dt2, ...")
    return _partial(f, t, (0,) * order, opts)


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
        chunk_size: width of one vectorised pass (see the note in ``_derivatives.py``).
        create_graph: keep the result differentiable with respect to parameters and input.

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
    opts = _validated(f, x, "x", structure, chunk_size, create_graph)
    return _partial(f, x, _check_dims(dims, math.prod(x.shape[1:])), opts)


def _partial(f: Fn, x: Tensor, dims: tuple[int, ...], opts: Options) -> Tensor:
    with _target(f, x, opts) as t:
        flat = t.over_samples(opts.chunk_size, (), lambda z, s: t.run("partial", z, dims, scale=s))
    return flat.reshape(x.shape[0], *t.out_shape)


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
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_derivatives.py``).
        create_graph: keep the result differentiable with respect to parameters and input.

    Returns:
        Shape (B, *out, D, D) (or (B, *out, *in, *in)).

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.]])
        >>> jm.hessian(lambda x: x[:, :1] ** 2 * x[:, 1:], x)     # u = x0^2 x1
        tensor([[[[4., 2.],
                  [2., 0.]]]])
    """
    opts = _validated(f, x, "x", structure, chunk_size, create_graph)
    with _target(f, x, opts) as t:
        n = math.prod(t.in_shape)
        ii, jj = torch.triu_indices(n, n).tolist()
        chunks, width = _direction_chunks(t, len(ii), opts.chunk_size)
        vals = torch.cat([
            t.over_samples(width, (len(c),), lambda z, s: t.run("pairs", z, ii[c.start : c.stop], jj[c.start : c.stop], scale=s))
            for c in chunks
        ]) if ii else t.z.new_zeros(0, x.shape[0], math.prod(t.out_shape))
        where = torch.zeros(n, n, dtype=torch.long, device=vals.device)
        where[ii, jj] = where[jj, ii] = torch.arange(len(ii), device=vals.device)
        full = vals[where].permute(2, 3, 0, 1)  # (B, Y, N, N)
    return full.reshape(x.shape[0], *t.out_shape, *t.in_shape, *t.in_shape)


def laplacian(
    f: Fn,
    x: Tensor,
    *,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Tensor:
    """Per-sample Laplacian (trace of the Hessian) of every output, without forming the Hessian.

    For a known ``nn.Sequential`` the forward Laplacian carries the value, the D first derivatives
    and their running Laplacian through the layers (about D + 2 passes); otherwise D nested jvps
    along the coordinates, vectorised.

    Args:
        f: maps x of shape (B, D) (or (B, *in)) to (B, *out).
        x: the batch of points.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_derivatives.py``).
        create_graph: keep the result differentiable with respect to parameters and input.

    Returns:
        Shape (B, *out): the sum over d of d^2 f / dx_d^2.

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2., 3.]])
        >>> jm.laplacian(lambda x: (x ** 3).sum(1), x)     # 6 (x0 + x1 + x2)
        tensor([36.])
    """
    opts = _validated(f, x, "x", structure, chunk_size, create_graph)
    with _target(f, x, opts) as t:
        chunks, width = _direction_chunks(t, math.prod(t.in_shape), opts.chunk_size)
        parts = [t.over_samples(width, (), lambda z, s: t.run("laplacian", z, c, scale=s)) for c in chunks]
        total = sum(parts[1:], parts[0]) if parts else t.z.new_zeros(x.shape[0], math.prod(t.out_shape))
    return total.reshape(x.shape[0], *t.out_shape)


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
        chunk_size: width of one vectorised pass (see the note in ``_derivatives.py``).
        create_graph: keep the result differentiable with respect to parameters and input.

    Returns:
        Shape (B,): the sum over d of d f_d / dx_d.

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.], [3., 4.]])
        >>> jm.divergence(lambda x: x ** 2, x)      # 2 (x0 + x1)
        tensor([ 6., 14.])
    """
    opts = _validated(f, x, "x", structure, chunk_size, create_graph)
    with _target(f, x, opts) as t:
        if t.out_shape != t.in_shape:
            raise ValueError(
                f"f: divergence needs a vector field whose output has the shape of its input, but "
                f"each sample maps {t.in_shape} to {t.out_shape}. Return one component per input "
                "coordinate, or use jacmode.jacobian for other shapes."
            )
        chunks, width = _direction_chunks(t, math.prod(t.in_shape), opts.chunk_size)
        total = x.new_zeros(x.shape[0]) if not chunks else None
        for c in chunks:
            jac = t.over_samples(width, (len(c),), lambda z, s: t.run("first", z, c, scale=s))
            k = torch.arange(len(c), device=jac.device)
            part = jac[k, :, torch.as_tensor(c, device=jac.device)].sum(0)  # (B,)
            total = part if total is None else total + part
    return total
