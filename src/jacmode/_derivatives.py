"""Derivative operators for physics-informed training, per sample and differentiable.

Each operator validates its arguments, builds the :class:`~jacmode._operands.Target` (which picks
Taylor mode for a known ``nn.Sequential`` and nested forward mode otherwise, see ``_operands.py``)
and assembles the user-facing shape.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _guard
from . import _args, _checks, _operators
from ._args import Argnums, InDims
from ._cache import Kind, register
from ._checks import Options
from ._autodiff import traceable as _traceable  # inside a user's torch.compile (see its note)
from . import _operands, _profile
from ._operands import (
    SUM_PASS_BYTES,
    Target,
    check_dims,
    direction_chunks,
    evaluate,
    validated,
)
from ._state import preserved_state
from ._sparse.api import sparse_hessian

Fn = Callable[[Tensor], Tensor]


@_guard.entry(_args.trailing_inputs("order", lambda v: _is_int(v)))
def derivative(
    f: Callable[..., Any],
    *args: Any,
    order: Optional[int] = None,
    argnums: Optional[Argnums] = None,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Any:
    """Per-sample derivative d^k y / dt^k for one scalar input per sample.

    Taylor mode (k + 1 coefficients, about k + 1 passes) for an ``nn.Sequential`` of ``nn.Linear``
    and known activations (Tanh, Sigmoid, SiLU, Softplus, ReLU, LeakyReLU, GELU); nested forward
    mode (about 2^k passes) for any other f. The cost does not grow with B beyond the batched pass.

    Args:
        f: maps t of shape (B,) or (B, 1) to (B, *out); or any f(*args) whose differentiated
            arguments (``argnums``) hold one scalar per sample in all, such as t in u(x, t).
        *args: t, one scalar per sample, shape (B,) or (B, 1). When f only accepts (B, 1) (a
            first layer ``nn.Linear(1, H)``), t of shape (B,) is passed as the column t[:, None].
            Or all of f's positional arguments.
        order: k >= 1, the order of the derivative (default 1). ``derivative(f, t, 2)`` still
            reads 2 as the order when f takes one argument; with several, pass ``order=``.
        argnums: which positional arguments are differentiated (an int or a tuple, torch.func's
            convention; default 0). Together they must hold one scalar per sample.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples,
            vmap's default) or None (broadcast); for all, per positional argument (a tuple), or
            by name or position (a dict).
        kwargs: keyword arguments for f, passed through (tensors treated as ``in_dims`` says).
        has_aux: f returns ``(output, aux)``; the result is then ``(derivative, aux)``.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B, *out): d^k f(t)[b] / dt_b^k; for a pytree output, that pytree of (B, *out_leaf).

    Example:
        >>> import torch, jacmode as jm
        >>> t = torch.linspace(0, 1, 5)
        >>> jm.derivative(lambda t: t ** 3, t)     # 3 t^2
        tensor([0.0000, 0.1875, 0.7500, 1.6875, 3.0000])
        >>> jm.derivative(lambda t: t ** 3, t, order=2)     # 6 t
        tensor([0.0000, 1.5000, 3.0000, 4.5000, 6.0000])
        >>> u = lambda x, t: x * t ** 3                   # u(x, t), one x and one t per sample
        >>> jm.derivative(u, torch.ones(5), t, argnums=1, order=2)   # u_tt = 6 x t
        tensor([0.0000, 1.5000, 3.0000, 4.5000, 6.0000])
    """
    if torch.compiler.is_dynamo_compiling():  # compile: the one-tensor form (no front: its caches do not trace)
        o = args[1] if order is None and len(args) == 2 else (1 if order is None else order)
        if not _traceable.simple(args, kwargs, argnums or 0, has_aux, trailing=1 if order is None else 0):
            return _traceable.eager("several arguments", lambda: derivative(
                f, *args, order=order, argnums=argnums, in_dims=in_dims, kwargs=kwargs, has_aux=has_aux,
                structure=structure, chunk_size=chunk_size, create_graph=create_graph))
        return _derivative(f, args[0], o, structure, chunk_size, create_graph)
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    args, legacy = _args.legacy_trailing(f, args, order is not None, _is_int, "order", "jm.derivative(u, x, t, argnums=1, order=2)")
    order = legacy if legacy is not None else (1 if order is None else order)
    call = _args.front(f, args, kwargs, argnums=0 if argnums is None else argnums, in_dims=in_dims,
                       has_aux=has_aux, name="t")
    if isinstance(order, bool) or not isinstance(order, int):
        raise TypeError(f"order: expected a positive int, got {type(order).__name__} ({order!r}).")
    if order < 1:
        raise ValueError(f"order: expected a positive int, got {order}. Use 1 for dy/dt, 2 for d2y/dt2, ...")
    if call.simple:
        return _derivative(f, call.x, order, structure, chunk_size, create_graph)
    n = call.x[0].numel() if call.x.dim() else 0
    if n != 1:
        raise ValueError(
            f"argnums: derivative differentiates along one scalar per sample, but the differentiated arguments "
            f"{call.argnums} hold {n} per sample. Pick one with argnums (e.g. argnums=1 for t in u(x, t)), or use "
            "jm.partial / jm.partials with named coordinates.")
    opts = validated(call.fn, call.x, "t", structure, chunk_size, create_graph)
    result = _partial(call.fn, call.x, (0,) * order, opts)
    # ---- tail: f's output pytree ----
    return _args.finish(call, call.outputs(result, (call.x.shape[0],)))


def _named(dims: Any) -> bool:
    """Whether coordinates are named (``"t"``, ``("x", 1)``): only the front reads names."""
    return isinstance(dims, (tuple, list)) and any(isinstance(c, (str, tuple)) for c in dims)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _derivative(f: Fn, t: Tensor, order: int, structure: Any, chunk_size: Any, create_graph: Any) -> Tensor:
    """The body of :func:`derivative` for a function of one tensor."""
    opts = validated(f, t, "t", structure, chunk_size, create_graph)
    if not (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)):
        raise ValueError(
            f"t: expected one scalar per sample, shape (B,) or (B, 1), got {tuple(t.shape)}. "
            "For several input coordinates use jacmode.partial or jacmode.jacobian."
        )
    if torch.compiler.is_dynamo_compiling():  # compile: a traceable path
        return _traceable.derivative(lambda: _derivative(f, t, order, structure, chunk_size, create_graph),
                                     f, t, order, opts.structure, opts.create_graph)
    if t.dim() == 1 and t.shape[0] > 0 and _needs_column(f, t):
        t = t.unsqueeze(1)
    return _partial(f, t, (0,) * order, opts)


_COLUMN = Kind("scalar inputs as a column")


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


COMMON_ARGS = ""  # (see the Args of each operator)


def _front(f: Any, args: tuple[Any, ...], kwargs: Any, argnums: Any, in_dims: Any, has_aux: Any,
           coords: Sequence[Any] = (), name: str = "x") -> _args.Call:
    """The call of a derivative operator: argnums default to the arguments ``coords`` name, else 0."""
    if argnums is None and coords:
        named = _args.coordinate_args(coords, _args.parameter_names(f), "dims")
        argnums = named if named is not None else 0
    return _args.front(f, args, kwargs, argnums=0 if argnums is None else argnums, in_dims=in_dims,
                       has_aux=has_aux, name=name)


def _coords(dims: Any) -> list[Any]:
    """The coordinates of one ``dims`` entry, as given (for naming arguments)."""
    if isinstance(dims, (str, bytes)):
        check_dims(dims, 1)  # the error for dims that are not a tuple of coordinates
    if isinstance(dims, int):
        return [dims]
    try:
        return list(dims)
    except TypeError:
        check_dims(dims, 1)
        raise


def _is_dims(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, (tuple, list)) and all(_is_int(d) or isinstance(d, str) for d in v))


# (dims of int tuples, D) -> check_dims of each
_TARGETS: dict[tuple[Any, ...], tuple[tuple[int, ...], ...]] = register({}, "checked partials' dims")


def _int_tuples(dims: Sequence[Any]) -> bool:
    """Every entry a tuple of ints (not bools: ``True == 1`` in a dict's key), as loops (every call)."""
    for d in dims:
        if type(d) is not tuple:
            return False
        for c in d:
            if type(c) is not int:
                return False
    return True


def _is_dims_list(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and bool(v) and all(isinstance(d, (tuple, list)) for d in v)


@_guard.entry(_args.trailing_inputs("dims", lambda v: _is_dims(v)))
def partial(
    f: Callable[..., Any],
    *args: Any,
    dims: Optional[Sequence[Any]] = None,
    argnums: Optional[Argnums] = None,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Any:
    """Per-sample mixed partial derivative of any order along input coordinates ``dims``.

    For x = (t, x1, x2) per sample: ``dims=(0,)`` is u_t, ``(1, 1)`` is u_x1x1, ``(1, 2)`` is
    u_x1x2, ``(0, 1, 1)`` is u_tx1x1. Same engines as :func:`derivative`. For f of several
    arguments, coordinates are named by f's parameter names: ``"t"`` (an argument with one
    coordinate per sample) or ``("x", 1)`` (coordinate 1 of x, counted flat).

    Args:
        f: maps x of shape (B, D) (or (B, *in), coordinates counted flat) to (B, *out); or any
            f(*args).
        *args: x, the batch of points, shape (B, D); or all of f's positional arguments.
        dims: the coordinates to differentiate along, one entry per order (negative ones count
            from the end); ints count flat through the differentiated arguments, names and
            ``(name, i)`` pairs pick an argument of f. ``partial(f, x, (0, 1))`` still reads
            (0, 1) as dims when f takes one argument; with several, pass ``dims=``.
        argnums: the differentiated positional arguments (an int or a tuple); by default those
            ``dims`` names, else 0. The others are passed through.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples,
            vmap's default) or None (broadcast); for all, per positional argument (a tuple), or
            by name or position (a dict).
        kwargs: keyword arguments for f, passed through (tensors treated as ``in_dims`` says).
        has_aux: f returns ``(output, aux)``; the result is then ``(partial, aux)``.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B, *out); for a pytree output, that pytree of (B, *out_leaf).

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.], [3., 1.]])
        >>> u = lambda x: x[:, :1] ** 2 * x[:, 1:] ** 3      # u = x0^2 x1^3, shape (B, 1)
        >>> jm.partial(u, x, (0, 1))                          # 6 x0 x1^2
        tensor([[24.],
                [18.]])
        >>> v = lambda x, t: x ** 2 * t                       # v(x, t), x and t of shape (B, 1)
        >>> jm.partial(v, x[:, :1], x[:, 1:], dims=("x", "t"))   # v_xt = 2 x
        tensor([[2.],
                [6.]])
    """
    if torch.compiler.is_dynamo_compiling():  # compile: the one-tensor form is partials of one entry (see there)
        d = args[1] if dims is None and len(args) == 2 else dims
        if d is not None and not _named(d) and _traceable.simple(args, kwargs, argnums or 0, has_aux,
                                                                trailing=1 if dims is None else 0):
            return partials(f, args[0], dims=[d], structure=structure, chunk_size=chunk_size,
                            create_graph=create_graph)[0]
        return _traceable.eager("several arguments", lambda: partial(
            f, *args, dims=dims, argnums=argnums, in_dims=in_dims, kwargs=kwargs, has_aux=has_aux,
            structure=structure, chunk_size=chunk_size, create_graph=create_graph))
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    args, legacy = _args.legacy_trailing(f, args, dims is not None, _is_dims, "dims",
                                         "jm.partial(u, x, t, dims=('x', 't'))")
    dims = legacy if legacy is not None else dims
    if dims is None:
        raise TypeError("dims: missing: pass the coordinates to differentiate along, e.g. dims=(0, 1) or "
                        "dims=('x', 't') for f(x, t).")
    call = _front(f, args, kwargs, argnums, in_dims, has_aux, _coords(dims))
    if call.simple:
        x = call.x
        opts = validated(f, x, "x", structure, chunk_size, create_graph)
        return _partial(f, x, check_dims(dims, math.prod(x.shape[1:])), opts)
    fn, x = call.fn, call.x
    opts = validated(fn, x, "x", structure, chunk_size, create_graph)
    result = _partial(fn, x, check_dims(_args.resolve(call, _coords(dims), "dims"), math.prod(x.shape[1:])), opts)
    # ---- tail: f's output pytree ----
    return _args.finish(call, call.outputs(result, (x.shape[0],)))


def _partial(f: Fn, x: Tensor, dims: tuple[int, ...], opts: Options) -> Tensor:
    def body(t: Target) -> Tensor:
        flat = t.over_samples(opts.chunk_size, (), lambda z, s: t.run("partial", z, dims, scale=s))
        return flat.reshape(x.shape[0], *t.out_shape)

    return evaluate(f, x, opts, body)


@_guard.entry(_args.trailing_inputs("dims", lambda v: _is_dims_list(v)))
def partials(
    f: Callable[..., Any],
    *args: Any,
    dims: Optional[Sequence[Sequence[Any]]] = None,
    argnums: Optional[Argnums] = None,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Any:
    """Several per-sample mixed partials of the same samples, from one shared propagation.

    A PINN residual such as u_t - nu * u_xx needs u_t and u_xx at the same points: on the Taylor
    path one pass carries the coefficients of every sub-multiset they need (u_x serves both u_x
    and u_xx), instead of one pass per partial. Each result is what :func:`partial` returns.
    For ``u(x, t)``, name the coordinates by f's parameter names:
    ``jm.partials(u, x, t, dims=[("t",), ("x", "x")])`` gives u_t and u_xx (see docs/pinn.md).

    Args:
        f: maps x of shape (B, D) (or (B, *in), coordinates counted flat) to (B, *out); or any
            f(*args).
        *args: x, the batch of points, shape (B, D); or all of f's positional arguments.
        dims: one tuple of coordinates per partial, e.g. ``[(0,), (1, 1)]`` for u_t and u_xx, or
            ``[("t",), ("x", "x")]`` naming f's arguments (``("x", 1)`` is coordinate 1 of x).
            ``partials(f, x, [(0,), (1, 1)])`` still reads the list as dims when f takes one
            argument; with several, pass ``dims=``.
        argnums: the differentiated positional arguments (an int or a tuple); by default those
            ``dims`` names, else 0. The others are passed through.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples,
            vmap's default) or None (broadcast); for all, per positional argument (a tuple), or
            by name or position (a dict).
        kwargs: keyword arguments for f, passed through (tensors treated as ``in_dims`` says).
        has_aux: f returns ``(output, aux)``; the result is then ``(partials, aux)``.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work).
        chunk_size: width of one vectorised pass (see the note in ``_operands.py``).
        create_graph: keep the results differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        A tuple with one tensor of shape (B, *out) per entry of ``dims``, in the order given (each
        a pytree of (B, *out_leaf) for a pytree output).

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.], [3., 1.]])
        >>> u = lambda x: x[:, :1] ** 2 * x[:, 1:] ** 3      # u = x0^2 x1^3, shape (B, 1)
        >>> u_0, u_11 = jm.partials(u, x, [(0,), (1, 1)])    # 2 x0 x1^3, 6 x0^2 x1
        >>> torch.cat([u_0, u_11], 1)
        tensor([[16., 12.],
                [ 6., 54.]])
        >>> v = lambda x, t: x ** 2 * t                       # v(x, t), x and t of shape (B, 1)
        >>> v_t, v_xx = jm.partials(v, x[:, :1], x[:, 1:], dims=[("t",), ("x", "x")])
        >>> torch.cat([v_t, v_xx], 1)                         # x^2, 2 t
        tensor([[1., 4.],
                [9., 2.]])
    """
    if torch.compiler.is_dynamo_compiling():  # compile: a traceable path for the one-tensor form (no front)
        ds = args[1] if dims is None and len(args) == 2 else dims
        if ds is None or any(_named(d) for d in ds) or not _traceable.simple(
                args, kwargs, argnums or 0, has_aux, trailing=1 if dims is None else 0):
            return _traceable.eager("several arguments", lambda: partials(
                f, *args, dims=dims, argnums=argnums, in_dims=in_dims, kwargs=kwargs, has_aux=has_aux,
                structure=structure, chunk_size=chunk_size, create_graph=create_graph))
        x = args[0]
        opts = validated(f, x, "x", structure, chunk_size, create_graph)
        return _traceable.partials(lambda: partials(f, x, dims=ds, structure=structure, chunk_size=chunk_size,
                                                    create_graph=create_graph),
                                   f, x, [check_dims(d, math.prod(x.shape[1:])) for d in ds], opts.structure,
                                   opts.create_graph)
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    args, legacy = _args.legacy_trailing(f, args, dims is not None, _is_dims_list, "dims",
                                         "jm.partials(u, x, t, dims=[('t',), ('x', 'x')])")
    dims = legacy if legacy is not None else dims
    # partials(f, x, [(0,), (1, 1)]) with dims of int tuples: no coordinate names an argument, the front's simple call
    plain = (len(args) == 1 and kwargs is None and has_aux is False and argnums is None and type(in_dims) is int
             and in_dims == 0 and isinstance(args[0], Tensor) and callable(f))
    looked = None
    if (plain and type(dims) in (list, tuple) and dims and (chunk_size is None or type(chunk_size) is int)
            and _int_tuples(dims)):
        # a repeated simple call: the code its profile holds ready, else the walk (for evaluate)
        known = _TARGETS.get((tuple(dims), math.prod(args[0].shape[1:])))  # dims checked before
        if known is not None:
            looked = _operands.direct_call(f, args[0], structure, create_graph, ("partials", known, chunk_size))
            if looked is not None and not isinstance(looked, _profile.Lookup):
                return looked
    if dims is None:
        raise TypeError("dims: missing: pass one tuple of coordinates per partial, e.g. dims=[(0,), (1, 1)] or "
                        "dims=[('t',), ('x', 'x')] for u(x, t).")
    if isinstance(dims, (str, bytes)) or not isinstance(dims, (list, tuple, Sequence)) or any(
            isinstance(d, (int, str)) for d in dims):
        raise TypeError(
            f"dims: expected a list of coordinate tuples, one per partial, e.g. [(0,), (1, 1)] for "
            f"u_t and u_xx, got {dims!r}. For a single partial use jacmode.partial.")
    if plain and _int_tuples(dims):
        call = None
        fn, x = f, args[0]
    else:
        call = _front(f, args, kwargs, argnums, in_dims, has_aux, [c for d in dims for c in _coords(d)])
        fn, x = call.fn, call.x
    opts = validated(fn, x, "x", structure, chunk_size, create_graph, devices=False)  # evaluate checks them
    if not dims:
        raise ValueError("dims: expected at least one partial, e.g. [(0,), (1, 1)], got an empty list.")
    n = math.prod(x.shape[1:])
    if call is None:  # dims of int tuples (checked above): each distinct dims checked once per D
        known = _TARGETS.get((tuple(dims), n))
        if known is None:
            known = tuple(check_dims(d, n) for d in dims)
            if len(_TARGETS) >= 256:
                _TARGETS.clear()
            _TARGETS[tuple(dims), n] = known
        targets = list(known)
    else:
        targets = [check_dims(d if call.simple else _args.resolve(call, _coords(d), "dims"), n) for d in dims]

    def body(t: Target) -> tuple[Tensor, ...]:
        flat = t.over_samples(opts.chunk_size, (len(targets),),
                              lambda z, s: t.run("partials", z, targets, scale=s))
        return tuple(r.reshape(x.shape[0], *t.out_shape) for r in flat.unbind(0))

    def direct(t: Target) -> Any:  # body as one engine call: all samples in one pass
        if (opts.chunk_size is not None and opts.chunk_size < t.z.shape[0]) or t.coupled or t.rng is not None \
                or not _all_there(t):
            return None
        shape = (x.shape[0], *t.out_shape)
        if len(t.out_shape) == 1:  # (k, B, Y): each partial is (B, Y) already
            return "partials", (targets,), lambda flat: flat.unbind(0)
        return "partials", (targets,), lambda flat: tuple([r.reshape(shape) for r in flat.unbind(0)])

    result = evaluate(fn, x, opts, body, (("partials", tuple(targets), opts.chunk_size), direct),
                      looked if call is None else None)
    if call is None or call.simple:
        return result
    # ---- tail: f's output pytree ----
    return _args.finish(call, tuple(call.outputs(r, (x.shape[0],)) for r in result))


@_guard.entry()
def hessian(
    f: Callable[..., Any],
    *args: Any,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Any:
    """Per-sample Hessian of every output with respect to the sample's input.

    Computes the D (D + 1) / 2 distinct second derivatives (Taylor mode or nested forward mode,
    vectorised over the pairs) and mirrors them for small D; for wider inputs (D > 2 Y + 1 with
    Taylor mode, sooner for other f, see the note [Rows or pairs]) the D rows per output by forward
    over reverse (a jvp of per-sample gradients, vectorised over the D directions).

    Args:
        f: maps x of shape (B, D) (or (B, *in)) to (B, *out); or any f(*args).
        *args: x, the batch of points; or all of f's positional arguments.
        argnums: the differentiated positional arguments (an int or a tuple, torch.func's
            convention); the others are passed through.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples) or
            None (broadcast); for all, per positional argument (a tuple), or by name (a dict).
        kwargs: keyword arguments for f, passed through.
        has_aux: f returns ``(output, aux)``; the result is then ``(hessian, aux)``.
        structure: "auto" checks that samples are independent; "independent" skips the check;
            "coupled" differentiates each sample with the others held fixed (B times the work);
            "sparse": x is one point and f scalar, the (N, N) sparse CSR Hessian from one
            Hessian-vector product per star colour (see :func:`jacmode.sparse_hessian`).
        chunk_size: width of one vectorised pass, in pairs or rows (see the note in ``_operands.py``).
        create_graph: keep the result differentiable with respect to parameters and input;
            always so inside torch.func transforms.

    Returns:
        Shape (B, *out, D, D) (or (B, *out, *in, *in)); (N, N) sparse for structure="sparse".
        Several arguments: torch.func's layout of ``vmap(hessian(f, argnums))``, e.g. for
        ``argnums=(0, 1)`` the nested tuple ``((H_xx, H_xt), (H_tx, H_tt))``, H_xt of shape
        (B, *out, *x_in, *t_in).

    Example:
        >>> import torch, jacmode as jm
        >>> x = torch.tensor([[1., 2.]])
        >>> jm.hessian(lambda x: x[:, :1] ** 2 * x[:, 1:], x)     # u = x0^2 x1
        tensor([[[[4., 2.],
                  [2., 0.]]]])
        >>> (h_xx, h_xt), (h_tx, h_tt) = jm.hessian(lambda x, t: x ** 2 * t, x[:, :1], x[:, 1:], argnums=(0, 1))
        >>> h_xx.shape, h_xt                                     # 2 t, 2 x
        (torch.Size([1, 1, 1, 1]), tensor([[[[2.]]]]))
    """
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    call = _args.front(f, args, kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux)
    if call.simple:
        return _hessian(f, call.x, structure, chunk_size, create_graph)
    if structure == "sparse":
        raise ValueError("structure: 'sparse' takes one tensor argument; for several arguments pass a function of "
                         "one tensor (concatenate the arguments and split them inside f).")
    x = call.x
    flat = _hessian(call.fn, x, structure, chunk_size, create_graph)
    # ---- tail: torch.func's layout ----
    n = math.prod(x.shape[1:])
    return _args.finish(call, call.hessian(flat.reshape(x.shape[0], -1, n, n)))


def _hessian(f: Fn, x: Tensor, structure: Any, chunk_size: Any, create_graph: Any) -> Tensor:
    """The body of :func:`hessian` for a function of one tensor."""
    if structure == "sparse":
        return sparse_hessian(f, x, chunk_size=chunk_size, create_graph=create_graph)
    opts = validated(f, x, "x", structure, chunk_size, create_graph)
    def body(t: Target) -> Tensor:
        n = math.prod(t.in_shape)
        if by_rows(n, math.prod(t.out_shape), t.program is not None):
            return _hessian_rows(t, x, opts)
        ii, jj = torch.triu_indices(n, n, device="cpu").tolist()
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


# NOTE: [Rows or pairs]
# The pairs (Taylor mode, or nested forward mode) push D (D + 1) / 2 second-order directions and
# get all Y outputs from each; forward over reverse pushes D directions, each through Y gradients
# (one vjp per output) and a jvp of them. In units of one pair, a row costs about
# ROW_COST * (Y + 1): measured with bench/hessian_engines.py (1 thread, tanh MLP D -> 64 -> 64 -> Y,
# B = 1024, float32, Taylor pairs over the captured program): for Y = 1 the rows win from D = 4
# (D = 3: 9 ms pairs, 21 ms rows; D = 4: 31 against 9; D = 32: 979 against 46), for Y = 4 from
# D = 8 to 16 (D = 8: 55 against 50; D = 16: 268 against 51). ROW_COST = 1 puts the switch at
# D > 2 Y + 1: small D (the PINN's 2 or 3 coordinates) keeps the Taylor pairs, whose passes are
# cheaper. The generic engine's pairs are nested jvps, dearer than Taylor's (D = 2: 24 ms, rows
# 9 ms; D = 32: 5.2 s against 42 ms; Y = 4, D = 2: 15 against 16, D = 3: 22 against 20, with
# --opaque): a row costs GENERIC_ROW_FACTOR = 0.3 times as many of those pairs, the rows from
# D = 1 for Y = 1 and from D = 3 for Y = 4.
ROW_COST = 1.0
GENERIC_ROW_FACTOR = 0.3


def by_rows(n: int, n_out: int, captured: bool = True) -> bool:
    """Whether the Hessian of n inputs and n_out outputs is cheaper as forward-over-reverse rows
    (``captured``: against Taylor mode's pairs, else against nested forward mode's)."""
    cost = ROW_COST * (1.0 if captured else GENERIC_ROW_FACTOR)
    return n * (n_out + 1) * cost < n * (n + 1) / 2


def _hessian_rows(t: Target, x: Tensor, opts: Options) -> Tensor:
    """The Hessian as D rows per output (``_autodiff/nested.rows``), the rows chunked as the pairs are."""
    n, n_out = math.prod(t.in_shape), math.prod(t.out_shape)
    # a row carries Y gradients (one per output) through the pass: Y times a pair's widest tensor
    chunks, width = direction_chunks(t, n, opts.chunk_size, _operands.DEFAULT_PASS_BYTES // max(n_out, 1))
    def block(c: range) -> Tensor:
        return t.over_samples(width, (len(c), n), lambda z, s: t.run("rows", z, list(c), scale=s))

    blocks = [block(c) for c in chunks]
    rows = torch.cat(blocks) if blocks else t.z.new_zeros(0, n, x.shape[0], n_out)  # (D, D, B, Y)
    full = rows.permute(2, 3, 0, 1)  # (B, Y, D, D)
    full = (full + full.transpose(-1, -2)) / 2  # exactly symmetric, as the pairs are
    return full.reshape(x.shape[0], *t.out_shape, *t.in_shape, *t.in_shape)


@_guard.entry()
def laplacian(
    f: Callable[..., Any],
    *args: Any,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
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
        f: maps x of shape (B, D) (or (B, *in)) to (B, *out); or any f(*args).
        *args: x, the batch of points; or all of f's positional arguments.
        argnums: the differentiated positional arguments (an int or a tuple, torch.func's
            convention; default 0); the others are passed through, so
            ``laplacian(u, x, t, argnums=0)`` is the Laplacian in x only, t held per sample.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples) or
            None (broadcast); for all, per positional argument (a tuple), or by name (a dict).
        kwargs: keyword arguments for f, passed through.
        has_aux: f returns ``(output, aux)``; the result is then ``(result, aux)``.
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
        >>> u = lambda x, t: (x ** 3).sum(1) * t             # u(x, t): the Laplacian in x only
        >>> jm.laplacian(u, x, torch.tensor([2.]), argnums=0)   # 6 (x0 + x1 + x2) t
        tensor([72.])
    """
    if torch.compiler.is_dynamo_compiling():  # compile: the one-tensor form (no front: its caches do not trace)
        if not _traceable.simple(args, kwargs, argnums, has_aux):
            return _traceable.eager("several arguments", lambda: laplacian(
                f, *args, argnums=argnums, in_dims=in_dims, kwargs=kwargs, has_aux=has_aux, weight=weight,
                samples=samples, distribution=distribution, generator=generator, return_std=return_std,
                structure=structure, chunk_size=chunk_size, create_graph=create_graph))
        return _laplacian(f, args[0], weight, samples, distribution, generator, return_std, structure,
                          chunk_size, create_graph)
    if (len(args) == 1 and kwargs is None and has_aux is False and type(argnums) is int and argnums == 0
            and type(in_dims) is int and in_dims == 0 and isinstance(args[0], Tensor) and callable(f)):
        # laplacian(f, x): what the front would find (a simple call), without it
        looked = None
        if weight is None and samples is None and return_std is False and (chunk_size is None or type(chunk_size) is int):
            looked = _operands.direct_call(f, args[0], structure, create_graph, ("laplacian", chunk_size))
            if looked is not None and not isinstance(looked, _profile.Lookup):  # the code its profile holds ready
                return looked  # type: ignore[no-any-return]
        return _laplacian(f, args[0], weight, samples, distribution, generator, return_std, structure,
                          chunk_size, create_graph, looked)
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    call = _args.front(f, args, kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux)
    result = _laplacian(call.fn, call.x, weight, samples, distribution, generator, return_std, structure,
                        chunk_size, create_graph)
    if call.simple:
        return result
    # ---- tail: f's output pytree ----
    lead = (call.x.shape[0],)
    out = tuple(call.outputs(r, lead) for r in result) if isinstance(result, tuple) else call.outputs(result, lead)
    return _args.finish(call, out)


def _laplacian(f: Fn, x: Tensor, weight: Any, samples: Any, distribution: Any, generator: Any, return_std: Any,
               structure: Any, chunk_size: Any, create_graph: Any,
               looked: Optional[_profile.Lookup] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The body of :func:`laplacian` for a function of one tensor (``looked``: the look-up of ``direct_call``)."""
    opts = validated(f, x, "x", structure, chunk_size, create_graph, devices=False)  # checked below
    compiling = torch.compiler.is_dynamo_compiling()
    if compiling or weight is not None or samples is not None or return_std:
        _checks.check_devices(f, x)  # evaluate checks them where it finds no profile
    if compiling:  # compile: a traceable path
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

    def direct(t: Target) -> Any:  # body as one engine call: one chunk of directions, all samples at once
        chunks, width = direction_chunks(t, math.prod(t.in_shape), opts.chunk_size, SUM_PASS_BYTES)
        if len(chunks) != 1 or width is not None or t.coupled or t.rng is not None or not _all_there(t):
            return None
        shape = (x.shape[0], *t.out_shape)
        if len(t.out_shape) == 1:  # (B, Y) already
            return "laplacian", (chunks[0],), _same
        return "laplacian", (chunks[0],), lambda out: out.reshape(shape)

    return evaluate(f, x, opts, body, (("laplacian", opts.chunk_size), direct), looked)


@_guard.entry()
def divergence(
    f: Callable[..., Any],
    *args: Any,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Any:
    """Per-sample divergence of a vector field f: (B, D) -> (B, D).

    Args:
        f: maps x of shape (B, D) (or (B, *in)) to an output of the same shape; or any f(*args)
            whose output has as many components per sample as its differentiated arguments.
        *args: x, the batch of points; or all of f's positional arguments.
        argnums: the differentiated positional arguments (an int or a tuple, torch.func's
            convention; default 0); the others are passed through, so
            ``divergence(v, x, t)`` is the divergence in x only, t held per sample.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples) or
            None (broadcast); for all, per positional argument (a tuple), or by name (a dict).
        kwargs: keyword arguments for f, passed through.
        has_aux: f returns ``(output, aux)``; the result is then ``(result, aux)``.
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
        >>> jm.divergence(lambda x, t: x ** 2 * t, x, torch.tensor([[1.], [2.]]))   # t: a rider
        tensor([ 6., 28.])
    """
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    call = _args.front(f, args, kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux)
    result = _divergence(call.fn, call.x, structure, chunk_size, create_graph)
    return result if call.simple else _args.finish(call, result)


def _divergence(f: Fn, x: Tensor, structure: Any, chunk_size: Any, create_graph: Any) -> Tensor:
    """The body of :func:`divergence` for a function of one tensor."""
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


def _same(out: Tensor) -> Tensor:
    return out


def _all_there(t: Target) -> bool:
    """Samples and outputs there are (``Target.over_samples`` returns zeros without running otherwise)."""
    return bool(t.z.shape[0]) and bool(math.prod(t.out_shape))


def _sum_over_coordinates(t: Target, opts: Options, term: Callable[[range, Optional[int]], Tensor], empty: Tensor) -> Tensor:
    """Sum ``term(chunk, width)`` over the chunks of the D coordinate directions (laplacian, divergence)."""
    chunks, width = direction_chunks(t, math.prod(t.in_shape), opts.chunk_size, SUM_PASS_BYTES)
    parts = [term(c, width) for c in chunks]
    return sum(parts[1:], parts[0]) if parts else empty
