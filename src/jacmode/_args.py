"""Describe a call ``f(*args, **kwargs)`` once as a flat problem, and restore torch.func's layout.

NOTE: [Several arguments]
The engines work on one function of one tensor: ``fn(z)`` with z of shape (b, D), b samples along
dim 0, returning (b, *out). A call in torch.func's language (several positional arguments,
``argnums`` choosing the differentiated ones, pytrees of tensors, keyword arguments, ``has_aux``,
pytree outputs) is reduced to that form here, once per call:

* the differentiated leaves (the tensors of ``args[i]`` for ``i`` in ``argnums``) are flattened per
  sample and concatenated along dim 1 into z (B, D) (unbatched: into (N,)); a single
  differentiated tensor is passed to the engines as it is, so a call ``f(x)`` is not wrapped at
  all (same function object, same caches, same speed as before);
* every other tensor (positional, in a pytree, or keyword) is a *rider*: batched along dim 0 with
  the samples (``in_dims=0``, vmap's default) or broadcast (``in_dims=None``); non-tensors are
  passed through untouched;
* :class:`Flat` is the flat function. It calls f on the whole batch with the riders as given;
  an engine that evaluates a sub-batch (probes on a few samples, chunks of samples) first asks
  :func:`take` for the flat function of those rows, so batched riders follow the samples. A flat
  function called on a batch of another size without :func:`take` raises instead of pairing
  samples with the wrong riders;
* outputs: the leaves of f's output pytree (after dropping the auxiliary output of ``has_aux``)
  are flattened per sample and concatenated into (b, Y); a single output tensor is returned as is;
* :meth:`Call.jacobian` turns the flat Jacobian (B, Y, D) back into torch.func's layout: for an
  int ``argnums`` the output pytree of input pytrees, for a tuple ``argnums`` the output pytree of
  tuples (one entry per argnum) of input pytrees, each block (B, *out_leaf, *in_leaf); and
  :meth:`Call.outputs` does the same for per-sample results shaped like f's output, (B, *out).

Coordinates of the derivative operators are counted in z: argument ``argnums[0]``'s leaves first,
flat per sample, then the next argnum's; :meth:`Call.coordinate` also reads names (``"t"``, the
name of a parameter of f with one coordinate per sample, or ``("x", 1)``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

Argnums = Union[int, tuple[int, ...]]
_OUTPUTS: "weakref.WeakKeyDictionary[Any, dict[tuple, tuple[Any, list[tuple[int, ...]]]]]" = weakref.WeakKeyDictionary()
InDims = Union[None, int, Sequence[Optional[int]], dict[Union[str, int], Optional[int]]]


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Leaf:
    """Where one differentiated tensor sits in z: columns [lo, lo + size) of each sample."""

    arg: int  # position among f's positional arguments
    index: int  # leaf index within that argument's pytree
    shape: tuple[int, ...]  # per-sample shape (the tensor's shape without dim 0 when batched)
    lo: int
    size: int


@dataclass
class Rider:
    """A tensor that is passed to f, not differentiated: batched with the samples or broadcast."""

    value: Tensor
    batched: bool


class Flat:
    """f as a function of one flat tensor z: (b, D) -> (b, *out) or (b, Y) (see the note).

    Attributes:
        f: the user's function.
        batch: B, the number of samples of the call (riders are indexed by it).
        rows: the rows of the call's batch this flat function evaluates (None: all B).
    """

    def __init__(self, call: "Call", rows: Optional[Tensor] = None,
                 values: Optional[list[Tensor]] = None) -> None:
        self.call = call
        self.f = call.f
        self.batch = call.batch
        self.rows = rows  # rows of the call's batch (take), or None
        self.values = values  # replacements of the batched riders, in order (with_riders), or None
        self.__wrapped__ = call.f  # what _state.used_modules and the caches look through

    def _riders(self, b: int) -> list[Any]:
        call = self.call
        out = list(call.leaves)
        batched = [i for i, r in call.riders.items() if r.batched]
        if self.values is not None:
            for i, v in zip(batched, self.values):
                out[i] = v
            return out
        want = self.batch if self.rows is None else int(self.rows.numel())
        if call.batched and b != want and batched:
            raise RuntimeError(
                f"jacmode internal error: the flat function of a call with batched riders was evaluated on "
                f"{b} samples instead of {want} without selecting the rows (report this); as a work-around, "
                "pass the per-sample arguments through a closure or give them in_dims=None.")
        for i in batched:
            v = call.riders[i].value
            out[i] = v if self.rows is None else v.index_select(0, self.rows.to(v.device))
        return out

    def __call__(self, z: Tensor) -> Any:
        call = self.call
        leaves = self._riders(z.shape[0] if call.batched else 1)
        b = z.shape[0] if call.batched else None
        for leaf in call.diff:
            cols = z[..., leaf.lo:leaf.lo + leaf.size] if len(call.diff) > 1 else z
            shape = (b, *leaf.shape) if b is not None else leaf.shape
            leaves[leaf.index] = cols.reshape(shape)
        args = tree_unflatten(leaves, call.args_spec)
        pos, kw = args
        out = call.f(*pos, **kw)
        return call.flat_output(out, b)


def traced_body(call: "Call") -> Callable[[Any, Any], Any]:
    """The flat function as ``body(z, riders)`` for graph capture (``_capture/capture.py``): the
    riders (:func:`inputs`) are an argument, so the captured program reads them on every run."""
    order = list(call.riders)

    def body(z: Any, riders: Any) -> Any:
        leaves = list(call.leaves)
        for i, j in enumerate(order):
            leaves[j] = riders[i]
        for leaf in call.diff:
            if len(call.diff) == 1:
                leaves[leaf.index] = z
                continue
            cols = z[:, leaf.lo:leaf.lo + leaf.size]  # (b, size): a reshape only where the leaf is not flat,
            leaves[leaf.index] = cols if leaf.shape == (leaf.size,) else cols.reshape(-1, *leaf.shape)  # (it
            # would give the seeds, shared by all samples, a batch dimension of b)
        pos, kw = tree_unflatten(leaves, call.args_spec)
        out = call.f(*pos, **kw)
        if call.has_aux:
            out = out[0]
        outs = tree_flatten(out)[0]
        if len(outs) == 1 and not isinstance(out, (tuple, list, dict)):
            return outs[0]
        return torch.cat([t.reshape(t.shape[0], -1) for t in outs], 1)

    return body


def take(fn: Any, rows: Union[Tensor, slice, int, Sequence[int]]) -> Any:
    """The flat function of a sub-batch: ``take(fn, idx)(z[idx])`` is ``fn(z)[idx]``.

    For a function that is not a :class:`Flat` (a call of one tensor), ``fn`` itself.
    """
    if not isinstance(fn, Flat) or not any(r.batched for r in fn.call.riders.values()):
        return fn
    base = torch.arange(fn.batch) if fn.rows is None else fn.rows
    if isinstance(rows, int):
        rows = [rows]
    sel = base[rows] if isinstance(rows, slice) else base[torch.as_tensor(rows, dtype=torch.long).reshape(-1)]
    return Flat(fn.call, sel)


def batched_riders(fn: Any) -> tuple[Tensor, ...]:
    """The batched riders of a flat function (its rows), in order; () for any other function.

    An engine that vmaps f over samples maps these along dim 0 with the samples and rebuilds the
    function of one sample with :func:`with_riders`::

        vmap(lambda zb, *rb: with_riders(fn, [r[None] for r in rb])(zb[None]))(z, *batched_riders(fn))
    """
    if not isinstance(fn, Flat):
        return ()
    leaves = fn._riders(fn.batch if fn.rows is None else int(fn.rows.numel()))
    return tuple(leaves[i] for i, r in fn.call.riders.items() if r.batched)


def inputs(fn: Any) -> tuple[Tensor, ...]:
    """Every tensor rider of a flat function (batched ones at its rows, broadcast ones as given), in
    leaf order: what a captured program of the call reads per run (``Program.bind``); ()
    for any other function."""
    if not isinstance(fn, Flat):
        return ()
    leaves = fn._riders(fn.batch if fn.rows is None else int(fn.rows.numel()))
    return tuple(leaves[i] for i in fn.call.riders)


def rows_of(fn: Any) -> Optional[int]:
    """How many samples a flat function with batched riders evaluates; None when any number will do."""
    if not isinstance(fn, Flat) or not any(r.batched for r in fn.call.riders.values()):
        return None
    if fn.values is not None:
        return int(fn.values[0].shape[0])
    return fn.batch if fn.rows is None else int(fn.rows.numel())


def with_riders(fn: Any, values: Sequence[Tensor]) -> Any:
    """``fn`` with its batched riders replaced by ``values`` (same order as :func:`batched_riders`)."""
    if not isinstance(fn, Flat) or not values:
        return fn
    return Flat(fn.call, None, list(values))


def signature(fn: Any) -> tuple:
    """What a flat function's structure is, for cache keys: () for a function of one tensor."""
    return fn.call.signature() if isinstance(fn, Flat) else ()


@dataclass
class Call:
    """One call of f, described: the flat function and input, and the layout to restore.

    Attributes:
        fn: the flat function (:class:`Flat`), or f itself for a call of one tensor.
        x: the flat input handed to the engines: (B, D) (unbatched (N,)), or the tensor itself.
        batch: B (1 when unbatched).
    """

    f: Callable[..., Any]
    batched: bool
    argnums: tuple[int, ...]
    int_argnums: bool
    has_aux: bool
    args_spec: TreeSpec  # of (args, kwargs)
    leaves: list[Any]  # all leaves of (args, kwargs), differentiated ones included
    diff: list[Leaf]
    diff_specs: dict[int, TreeSpec]  # argnum -> pytree spec of that argument
    riders: dict[int, Rider]  # leaf index -> rider
    batch: int
    names: tuple[str, ...]  # f's positional parameter names, as far as known
    out_spec: Any = None  # TreeSpec of f's output without aux, once f was evaluated
    out_shapes: list[tuple[int, ...]] = field(default_factory=list)  # per-sample output leaf shapes
    fn: Any = None
    x: Any = None
    simple: bool = False  # one differentiated tensor, nothing else: fn is f, x is that tensor
    _signature: Optional[tuple] = None

    def signature(self) -> tuple:
        """The call's structure without values: pytree specs, argnums, riders' kinds and shapes,
        the non-tensor arguments (by value when hashable, else by identity). Computed once per call."""
        if self._signature is None:
            self._signature = self._structure()
        return self._signature

    def _structure(self) -> tuple:
        others: list[Any] = []
        for j, v in enumerate(self.leaves):
            if isinstance(v, Tensor):
                r = self.riders.get(j)
                shape = tuple(v.shape[1:]) if r is not None and r.batched else tuple(v.shape)
                others.append(None if r is None else (r.batched, shape, v.dtype, v.device))
            else:
                try:
                    hash(v)
                    others.append(("value", type(v), v))
                except TypeError:
                    others.append(("id", id(v)))
        return (str(self.args_spec), self.argnums, self.int_argnums, self.has_aux, self.batched,
                tuple(others))

    def _out_key(self) -> tuple:
        return (self.signature(), tuple(leaf.shape for leaf in self.diff))

    def _remember(self) -> None:
        """Keep the output structure for later calls of the same structure (whose engine may run a
        captured program only, never f itself)."""
        try:
            _OUTPUTS.setdefault(self.f, {})[self._out_key()] = (self.out_spec, self.out_shapes)
        except TypeError:  # f not weakly referenceable, or an unhashable key: not kept
            pass

    def recall(self) -> None:
        """The output structure of an earlier call of the same structure, if known."""
        try:
            known = _OUTPUTS.get(self.f, {}).get(self._out_key())
        except TypeError:
            known = None
        if known is not None and self.out_spec is None:
            self.out_spec, self.out_shapes = known

    # ---- outputs -------------------------------------------------------------------------
    def flat_output(self, out: Any, b: Optional[int]) -> Tensor:
        """f's output without aux, as one tensor: a single tensor as is, else (b, Y) / (Y,)."""
        if self.has_aux:
            out = _split_aux(out)[0]
        leaves, spec = tree_flatten(out)
        if not leaves or not all(isinstance(t, Tensor) for t in leaves):
            raise TypeError(
                f"f: expected f to return a tensor or a pytree (tuple, list, dict) of tensors, got "
                f"{type(out).__name__} ({_fmt(out)}). Return tensors only; put anything else in the auxiliary "
                "output with has_aux=True.")
        shapes = [tuple(t.shape[1:]) if b is not None else tuple(t.shape) for t in leaves]
        if self.out_spec is None:
            self.out_spec, self.out_shapes = spec, shapes
            self._remember()
        elif spec != self.out_spec or shapes != self.out_shapes:
            raise ValueError(
                f"f: returned a different output structure on a later evaluation ({spec} with per-sample shapes "
                f"{shapes}, first {self.out_spec} with {self.out_shapes}). jacmode evaluates f several times; "
                "its outputs must keep their structure.")
        if len(leaves) == 1 and not isinstance(out, (tuple, list, dict)):
            return leaves[0]
        if b is not None:
            for t in leaves:
                if t.dim() == 0 or t.shape[0] != b:
                    raise ValueError(
                        f"f: every output must have the batch dimension {b} first when batched=True, got an output "
                        f"of shape {tuple(t.shape)}. Return per-sample outputs, or pass batched=False.")
            return torch.cat([t.reshape(b, -1) for t in leaves], dim=1)
        return torch.cat([t.reshape(-1) for t in leaves])

    def _out_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        lo, blocks = 0, []
        for s in self.out_shapes:
            n = math.prod(s)
            blocks.append((lo, n, s))
            lo += n
        return blocks

    def _ensure(self) -> None:
        """Learn the output structure by one evaluation when no engine evaluated f (rarely needed)."""
        if self.out_spec is None:
            from ._state import preserved_state  # noqa: PLC0415 -- _state imports this module

            with torch.no_grad(), preserved_state(self.f):
                Flat(self)(self.x.detach())

    def single_output(self) -> bool:
        self._ensure()
        return self.out_spec is not None and self.out_spec.num_leaves == 1 and self.out_spec.type is None

    def outputs(self, flat: Tensor, lead: tuple[int, ...]) -> Any:
        """A per-sample result shaped like the flat output, ``(*lead, *out)``, in f's output pytree."""
        if self.single_output():
            return flat
        parts = [flat.reshape(*lead, -1)[..., lo:lo + n].reshape(*lead, *s) for lo, n, s in self._out_blocks()]
        self._ensure()
        return tree_unflatten(parts, self.out_spec)

    def jacobian(self, flat: Tensor) -> Any:
        """The flat Jacobian (B, Y, D) (unbatched (Y, N)) in torch.func's layout (see the note)."""
        lead = (flat.shape[0],) if self.batched else ()
        self._ensure()
        outs = self._out_blocks()
        per_out = []
        for lo_y, n_y, s_y in outs:
            rows = flat[:, lo_y:lo_y + n_y] if self.batched else flat[lo_y:lo_y + n_y]
            per_arg = []
            for a in self.argnums:
                mine = [leaf for leaf in self.diff if leaf.arg == a]
                blocks = [rows[..., leaf.lo:leaf.lo + leaf.size].reshape(*lead, *s_y, *leaf.shape) for leaf in mine]
                per_arg.append(tree_unflatten(blocks, self.diff_specs[a]))
            per_out.append(per_arg[0] if self.int_argnums else tuple(per_arg))
        if self.single_output():
            return per_out[0]
        return tree_unflatten(per_out, self.out_spec)

    def hessian(self, flat: Tensor) -> Any:
        """The flat per-sample Hessian (B, Y, D, D) in torch.func's layout (``hessian(f, argnums)``
        under vmap): per output leaf, for an int argnums the input pytree of input pytrees, for a
        tuple the tuple (argnum i) of input pytrees of tuples (argnum j) of input pytrees, each
        block (B, *out_leaf, *in_i_leaf, *in_j_leaf)."""
        lead = (flat.shape[0],)
        self._ensure()
        per_out = []

        def inner(rows: Tensor, s_y: tuple[int, ...], li: Leaf) -> Any:
            per_arg = []
            for a in self.argnums:
                blocks = [rows[..., li.lo:li.lo + li.size, lj.lo:lj.lo + lj.size].reshape(*lead, *s_y, *li.shape, *lj.shape)
                          for lj in self.diff if lj.arg == a]
                per_arg.append(tree_unflatten(blocks, self.diff_specs[a]))
            return per_arg[0] if self.int_argnums else tuple(per_arg)

        for lo_y, n_y, s_y in self._out_blocks():
            rows = flat[:, lo_y:lo_y + n_y]
            per_arg = [tree_unflatten([inner(rows, s_y, li) for li in self.diff if li.arg == a], self.diff_specs[a])
                       for a in self.argnums]
            per_out.append(per_arg[0] if self.int_argnums else tuple(per_arg))
        if self.single_output():
            return per_out[0]
        return tree_unflatten(per_out, self.out_spec)

    def aux(self) -> Any:
        """The auxiliary output of ``has_aux=True`` at the call's arguments (one more call of f)."""
        pos, kw = tree_unflatten(list(self.leaves), self.args_spec)
        return _split_aux(self.f(*pos, **kw))[1]

    # ---- coordinates ---------------------------------------------------------------------
    def coordinate(self, c: Any, name: str = "dims") -> int:
        """The column of z of coordinate ``c``: an int (counted flat in z), an argument's name with one
        coordinate per sample (``"t"``), or a pair (name or position, index within that argument)."""
        if isinstance(c, bool):
            raise TypeError(f"{name}: expected coordinates as ints or argument names, got {c!r}.")
        if isinstance(c, int):
            return c
        if isinstance(c, str):
            arg, idx = self._arg_of(c, name), None
        elif isinstance(c, tuple) and len(c) == 2 and isinstance(c[1], int) and isinstance(c[0], (str, int)):
            arg, idx = (self._arg_of(c[0], name) if isinstance(c[0], str) else c[0]), c[1]
        else:
            raise TypeError(
                f"{name}: expected a coordinate as an int, an argument name such as 't', or a pair such as "
                f"('x', 1), got {c!r}.")
        mine = [leaf for leaf in self.diff if leaf.arg == arg]
        if not mine:
            raise ValueError(
                f"{name}: coordinate {c!r} names argument {arg}, which is not differentiated (argnums="
                f"{self.argnums}). Add it to argnums.")
        size = sum(leaf.size for leaf in mine)
        if idx is None:
            if size != 1:
                raise ValueError(
                    f"{name}: argument {c!r} has {size} coordinates per sample; name one of them as "
                    f"({c!r}, i) with 0 <= i < {size}.")
            idx = 0
        if not -size <= idx < size:
            raise ValueError(f"{name}: coordinate {c!r} is out of range: argument {arg} has {size} coordinates "
                             "per sample.")
        return mine[0].lo + idx % size

    def _arg_of(self, label: str, name: str) -> int:
        if label not in self.names:
            raise ValueError(
                f"{name}: {label!r} is not the name of a positional argument of f (its arguments are "
                f"{list(self.names)}). Name coordinates by f's parameter names, or by position as (argnum, i).")
        return self.names.index(label)


def _split_aux(out: Any) -> tuple[Any, Any]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"f: has_aux=True expects f to return a pair (output, aux), got {type(out).__name__} "
            f"({_fmt(out)}). Return `out, aux`, or pass has_aux=False.")
    return out


_SIGNATURES: "weakref.WeakKeyDictionary[Any, tuple[tuple[str, ...], Optional[bool]]]" = weakref.WeakKeyDictionary()


def _positional(f: Any) -> tuple[tuple[str, ...], Optional[bool]]:
    """(names of f's positional parameters, whether it takes exactly one or fewer; None: unknown),
    from ``inspect.signature`` of f (a module's forward), remembered per function (or module class)."""
    key = type(f) if isinstance(f, torch.nn.Module) else f
    try:
        hit = _SIGNATURES.get(key)
    except TypeError:
        hit = None
    if hit is not None:
        return hit
    target = f.forward if isinstance(f, torch.nn.Module) else f
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        found: tuple[tuple[str, ...], Optional[bool]] = ((), None)
    else:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = tuple(p.name for p in params if p.kind in kinds)
        varargs = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
        found = (names, False if varargs else len(names) <= 1)
    try:
        _SIGNATURES[key] = found
    except TypeError:  # not weakly referenceable: not remembered
        pass
    return found


def parameter_names(f: Any) -> tuple[str, ...]:
    """The names of f's positional parameters (a module's forward's), or () when unknown."""
    return _positional(f)[0]


def check_argnums(argnums: Any, n_args: int) -> tuple[tuple[int, ...], bool]:
    """Normalised ``argnums`` (non-negative, in the order given) and whether it was an int."""
    as_int = isinstance(argnums, int) and not isinstance(argnums, bool)
    items = (argnums,) if as_int else argnums
    if not isinstance(items, tuple) or not items or not all(
            isinstance(a, int) and not isinstance(a, bool) for a in items):
        raise TypeError(
            f"argnums: expected an int or a non-empty tuple of ints (torch.func's convention), got {_fmt(argnums)}. "
            "Use e.g. argnums=0 or argnums=(0, 1).")
    out = []
    for a in items:
        if not -n_args <= a < n_args:
            raise ValueError(
                f"argnums: {a} is out of range for a call with {n_args} positional argument(s). Pass argnums "
                f"between {-n_args} and {n_args - 1}.")
        out.append(a % n_args)
    if len(set(out)) != len(out):
        raise ValueError(f"argnums: each argument may be named once, got {argnums!r}.")
    return tuple(out), as_int


def _in_dim(in_dims: Any, pos: Optional[int], key: Optional[str], names: tuple[str, ...]) -> Optional[int]:
    """in_dims of one argument (positional ``pos`` or keyword ``key``): 0 (batched) or None (broadcast)."""
    if in_dims is None or isinstance(in_dims, int):
        return in_dims
    if isinstance(in_dims, (tuple, list)):
        return in_dims[pos] if pos is not None else 0
    assert isinstance(in_dims, dict)
    if key is not None:
        return in_dims.get(key, 0)
    assert pos is not None
    if pos in in_dims:
        return in_dims[pos]
    if pos < len(names) and names[pos] in in_dims:
        return in_dims[names[pos]]
    return 0


def check_in_dims(in_dims: Any, n_args: int) -> None:
    """``in_dims``: 0 or None for all, a tuple with one 0/None per positional argument, or a dict."""
    def ok(v: Any) -> bool:
        return v is None or (v == 0 and isinstance(v, int) and not isinstance(v, bool))

    if ok(in_dims):
        return
    if isinstance(in_dims, (tuple, list)):
        if len(in_dims) != n_args or not all(ok(v) for v in in_dims):
            raise ValueError(
                f"in_dims: expected one entry (0: batched with the samples, None: broadcast) per positional "
                f"argument ({n_args}), got {_fmt(in_dims)}.")
        return
    if isinstance(in_dims, dict):
        if not all(ok(v) for v in in_dims.values()):
            raise ValueError(f"in_dims: each value must be 0 (batched) or None (broadcast), got {_fmt(in_dims)}.")
        return
    raise TypeError(
        f"in_dims: expected 0, None, a tuple with one 0/None per positional argument, or a dict "
        f"{{name or position: 0/None}}, got {_fmt(in_dims)}. (jacmode batches along dim 0 only.)")


def describe_call(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Optional[dict[str, Any]] = None,
    *,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    has_aux: bool = False,
    batched: bool = True,
    floating: bool = True,
) -> Call:
    """Describe ``f(*args, **kwargs)`` as a flat problem (see the note).

    Args:
        f: the user's function.
        args: its positional arguments; ``args[i]`` for i in ``argnums`` are differentiated (tensors or
            pytrees of tensors).
        kwargs: keyword arguments passed through.
        argnums: which positional arguments are differentiated.
        in_dims: how non-differentiated tensors are treated: 0 batched along dim 0 with the samples,
            None broadcast; for all, per positional argument (tuple), or by name/position (dict).
        has_aux: f returns (output, aux); aux is not differentiated.
        batched: dim 0 of every differentiated tensor holds the B samples.
        floating: differentiated tensors must be floating point (False: the caller checks).

    Returns:
        The :class:`Call`; ``call.fn`` and ``call.x`` are what the engines take.
    """
    kwargs = dict(kwargs or {})
    if not isinstance(args, tuple) or not args:
        raise TypeError("f: expected at least one positional argument to differentiate with respect to.")
    nums, as_int = check_argnums(argnums, len(args))
    check_in_dims(in_dims, len(args))
    names = parameter_names(f)
    leaves, spec = tree_flatten((tuple(args), kwargs))
    # leaf index ranges per positional argument
    starts, i = [], 0
    for a in args:
        starts.append(i)
        i += len(tree_flatten(a)[0])
    n_pos = i
    owner = [next(k for k in range(len(args)) if starts[k] <= j < (starts[k + 1] if k + 1 < len(args) else n_pos))
             for j in range(n_pos)]
    diff: list[Leaf] = []
    diff_specs: dict[int, TreeSpec] = {}
    batch: Optional[int] = None
    lo = 0
    for a in nums:
        a_leaves, a_spec = tree_flatten(args[a])
        diff_specs[a] = a_spec
        if not a_leaves:
            raise ValueError(f"argnums: argument {a} holds no tensors to differentiate ({_fmt(args[a])}).")
        for k, t in enumerate(a_leaves):
            where = f"argument {a}" + (f" (leaf {k})" if len(a_leaves) > 1 else "")
            if not isinstance(t, Tensor):
                raise TypeError(
                    f"{where}: expected a tensor to differentiate, got {type(t).__name__} ({_fmt(t)}). Differentiated "
                    "arguments must be tensors or pytrees (tuple, list, dict) of tensors; move other values out of "
                    "argnums.")
            if floating and not t.is_floating_point():
                raise TypeError(
                    f"{where}: differentiating needs a real floating dtype, got {t.dtype}. Convert with `.float()`, "
                    "or leave it out of argnums (integer ids, masks) so it is passed through.")
            if batched:
                if t.dim() == 0:
                    raise ValueError(
                        f"{where}: batched=True needs a batch dimension, got a 0-d tensor. Pass it with a "
                        "leading sample dimension, or batched=False.")
                if batch is None:
                    batch = t.shape[0]
                elif t.shape[0] != batch:
                    raise ValueError(
                        f"{where}: every differentiated tensor needs the same number of samples along dim 0, got "
                        f"{t.shape[0]} and {batch}.")
            shape = tuple(t.shape[1:]) if batched else tuple(t.shape)
            size = math.prod(shape)
            diff.append(Leaf(arg=a, index=starts[a] + k, shape=shape, lo=lo, size=size))
            lo += size
    dtypes = {leaves[d.index].dtype for d in diff}
    devices = {leaves[d.index].device for d in diff}
    if len(dtypes) > 1 or len(devices) > 1:
        raise TypeError(
            f"argnums: the differentiated tensors must share one dtype and device, got {sorted(map(str, dtypes))} on "
            f"{sorted(map(str, devices))}. Convert them, e.g. `t.to(x)`.")
    b = batch if batched and batch is not None else 1
    diff_index = {d.index for d in diff}
    riders: dict[int, Rider] = {}
    kw_names = list(kwargs)
    kw_leaf_owner: dict[int, str] = {}
    j = n_pos
    for name in kw_names:
        for _ in tree_flatten(kwargs[name])[0]:
            kw_leaf_owner[j] = name
            j += 1
    for j, t in enumerate(leaves):
        if j in diff_index or not isinstance(t, Tensor):
            continue
        pos = owner[j] if j < n_pos else None
        dim = _in_dim(in_dims, pos, kw_leaf_owner.get(j), names) if batched else None
        if dim == 0:
            where = f"argument {pos}" if pos is not None else f"keyword argument {kw_leaf_owner[j]!r}"
            if t.dim() == 0 or t.shape[0] != b:
                raise ValueError(
                    f"in_dims: {where} is batched along dim 0 with the samples (in_dims=0, vmap's default), but "
                    f"its shape {tuple(t.shape)} has no dim 0 of size B = {b}. Pass in_dims=None for it (broadcast "
                    "to every sample), e.g. in_dims=" + ("(0, None)" if pos is not None else "{'name': None}") + ".")
        riders[j] = Rider(value=t, batched=dim == 0)
    call = Call(f=f, batched=batched, argnums=nums, int_argnums=as_int, has_aux=has_aux, args_spec=spec,
                leaves=leaves, diff=diff, diff_specs=diff_specs, riders=riders, batch=b, names=names)
    simple = (len(args) == 1 and not kwargs and len(diff) == 1 and not has_aux and as_int
              and diff_specs[nums[0]].num_leaves == 1 and diff_specs[nums[0]].type is None)
    call.simple = simple
    call.recall()
    if simple:
        call.fn, call.x = f, leaves[diff[0].index]
    else:
        call.fn = Flat(call)
        ts = [leaves[d.index] for d in diff]
        if len(ts) == 1:
            call.x = ts[0]  # its own shape: (B, *in)
        else:
            call.x = torch.cat([t.reshape(b, -1) if batched else t.reshape(-1) for t in ts], dim=-1)
    return call


# ---- the entry points' front and tail ------------------------------------------------------------
def front(
    f: Any,
    args: tuple[Any, ...],
    kwargs: Any = None,
    *,
    argnums: Any = 0,
    in_dims: Any = 0,
    has_aux: Any = False,
    batched: bool = True,
    floating: bool = True,
    name: str = "x",
) -> Call:
    """Validate and describe the call of an entry point ``ep(f, *args, argnums=, in_dims=,
    kwargs=, has_aux=)``; ``call.fn`` and ``call.x`` are what the existing body takes.

    A call of one tensor (``ep(f, x)``) is ``simple``: ``call.fn is f`` and ``call.x is x``, and
    the body's own input checks speak as before.
    """
    if not callable(f):
        raise TypeError(
            f"f: expected an nn.Module or a callable, got {type(f).__name__} ({_fmt(f)}). Pass the model "
            "itself or a function such as `lambda x, t: model(torch.cat([x, t], 1))`.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux: expected True or False, got {type(has_aux).__name__} ({_fmt(has_aux)}).")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise TypeError(
            f"kwargs: expected a dict of f's keyword arguments (name -> value), got {type(kwargs).__name__} "
            f"({_fmt(kwargs)}). e.g. kwargs={{'mask': mask}}.")
    if not args:
        raise TypeError(
            f"{name}: missing: pass the input(s) of f after f, e.g. jm.jacobian(f, x) or jm.jacobian(u, x, t, "
            "argnums=(0, 1)).")
    if len(args) == 1 and not kwargs and not has_aux and isinstance(argnums, int) and not isinstance(argnums, bool):
        x = args[0]
        if isinstance(x, Tensor) or not any(isinstance(v, Tensor) for v in tree_flatten(x)[0]):
            check_argnums(argnums, 1)  # one input: the body checks it and speaks as before
            check_in_dims(in_dims, 1)
            return Call(f=f, batched=batched, argnums=(0,), int_argnums=True, has_aux=False, args_spec=None,  # type: ignore[arg-type]
                        leaves=[x], diff=[], diff_specs={}, riders={}, batch=0, names=(), fn=f, x=x, simple=True)
    return describe_call(f, tuple(args), kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux,
                         batched=batched, floating=floating)


def flat_jacobian(call: Call, result: Tensor) -> Tensor:
    """An engine's (B, *out, *in) result for ``call.fn`` at ``call.x`` as (B, Y, D) (unbatched (Y, N))."""
    if call.batched:
        return result.reshape(result.shape[0], -1, math.prod(call.x.shape[1:]))
    return result.reshape(-1, call.x.numel())


def finish(call: Call, result: Any) -> Any:
    """``result``, with the auxiliary output of ``has_aux=True`` as torch.func returns it: a pair."""
    return (result, call.aux()) if call.has_aux else result


def accepts_one(f: Any) -> Optional[bool]:
    """Whether f takes exactly one positional argument (None when its signature is unknown)."""
    return _positional(f)[1]


def legacy_trailing(f: Any, args: tuple[Any, ...], given: bool, looks: Callable[[Any], bool], option: str,
                    example: str) -> tuple[tuple[Any, ...], Any]:
    """Split the one-argument call ``ep(f, x, <option>)`` of the derivative operators (``order``,
    ``dims``, ``terms`` given positionally, as before several arguments) from ``ep(f, *args)``.

    The last positional argument is read as ``option`` when it is not given by keyword, there are
    exactly two positional arguments, and f takes one positional argument (or its signature is
    unknown and the last one looks like the option, with no tensor but a term's coefficient). When f takes more, the call is
    ambiguous: a clear error asks for the keyword. Returns (args, the option or None).
    """
    if given or len(args) != 2:
        return args, None
    one = accepts_one(f)
    if one is True:  # f takes one argument: the last one is the option, whatever it is (checked later)
        return args[:1], args[1]
    if not looks(args[1]) or (option != "terms" and any(isinstance(v, Tensor) for v in tree_flatten(args[1])[0])):
        return args, None
    if one is False:
        raise TypeError(
            f"{option}: ambiguous call: f takes several positional arguments, and the last argument "
            f"{_fmt(args[1])} could be {option} (the one-argument form ep(f, x, {option})) or an argument of f. "
            f"Pass it by keyword: {example}; an argument of f that is a number goes after it, "
            "with argnums saying which arguments are differentiated.")
    return args[:1], args[1]


def coordinate_args(coords: Sequence[Any], names: tuple[str, ...], name: str) -> Optional[tuple[int, ...]]:
    """The positional arguments named by coordinates (``"t"``, ``("x", 1)``, ``(0, 1)`` pairs), sorted;
    None when no coordinate names an argument. Plain int coordinates next to names are an error
    (they count in the flat input, which depends on argnums)."""
    named, plain = set(), False
    for c in coords:
        if isinstance(c, str):
            if c not in names:
                raise ValueError(
                    f"{name}: {c!r} is not the name of a positional argument of f (its arguments are "
                    f"{list(names)}). Name coordinates by f's parameter names, or by position as (argnum, i).")
            named.add(names.index(c))
        elif isinstance(c, tuple) and len(c) == 2 and isinstance(c[1], int) and isinstance(c[0], (str, int)) \
                and not isinstance(c[0], bool):
            if isinstance(c[0], str):
                if c[0] not in names:
                    raise ValueError(
                        f"{name}: {c[0]!r} is not the name of a positional argument of f (its arguments are "
                        f"{list(names)}). Name coordinates by f's parameter names, or by position as (argnum, i).")
                named.add(names.index(c[0]))
            else:
                named.add(c[0])
        else:
            plain = True
    if not named:
        return None
    if plain:
        raise ValueError(
            f"{name}: mixes argument names with plain int coordinates; plain ints count in the concatenated "
            "differentiated arguments, which depend on argnums. Name every coordinate (e.g. ('x', 0)), or pass "
            "argnums explicitly.")
    return tuple(sorted(named))


def resolve(call: Call, coords: Sequence[Any], name: str) -> tuple[Any, ...]:
    """Coordinates (ints, names, pairs) as columns of the flat input (ints pass through unchecked)."""
    if call.simple:
        return tuple(coords)
    return tuple(call.coordinate(c, name) for c in coords)


# ---- parameters of a module called with several arguments ------------------------------------------
_ROWS_OF: "weakref.WeakKeyDictionary[torch.nn.Module, Call]" = weakref.WeakKeyDictionary()
_SUBCLASSES: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _forward_rows(self: torch.nn.Module, rows: Tensor) -> Tensor:
    """forward of :func:`module_of_rows`: the model's own forward on the arguments of samples ``rows``."""
    call = _ROWS_OF.get(self)
    if call is None:
        raise RuntimeError("jacmode internal error: the module of sample indices of a model of several arguments "
                           "ran outside its call (report this)")
    leaves = list(call.leaves)
    for j, r in call.riders.items():
        if r.batched:
            leaves[j] = r.value.index_select(0, rows.to(r.value.device))
    pos, kw = tree_unflatten(leaves, call.args_spec)
    out = type(call.f).forward(self, *pos, **kw)  # type: ignore[attr-defined]
    return call.flat_output(out, rows.shape[0] if call.batched else None)


def params_call(f: Any, args: tuple[Any, ...], kwargs: Any, *, in_dims: Any, has_aux: bool,
                batched: bool) -> Call:
    """The call ``model(*args, **kwargs)`` differentiated with respect to the model's parameters.

    Every argument is passed through (batched along dim 0 or broadcast, as ``in_dims`` says). The
    engines get ``call.fn``, the model seen as a function of sample indices (:func:`module_of_rows`),
    and ``call.x``, the indices 0..B-1 (unbatched: [0]): every engine that evaluates a sample, a
    chunk of samples or a probe on a few selects their arguments by the indices it passes, also
    under vmap. Parameter names, hooks, flags and state are the model's own (shared, not copied).
    """
    if not isinstance(f, torch.nn.Module):
        raise TypeError(
            f"f: wrt='params' differentiates the parameters of an nn.Module, got {type(f).__name__}. Pass the "
            "model itself.")
    if len(args) == 1 and isinstance(args[0], (tuple, list)) and any(isinstance(v, Tensor) for v in tree_flatten(args[0])[0]):
        raise TypeError(
            f"x: got a {type(args[0]).__name__} of {len(args[0])} items, which jm.jacobian(model, x, wrt='params') "
            "would pass to the model as one argument. For a model of several arguments pass them separately: "
            "jm.jacobian(model, x, mask, wrt='params') (in_dims says which are batched with the samples). A tuple "
            "or list of tensors is not read as a data set either: pass data sets as an iterable of batches such as "
            "a DataLoader to jm.jacobians (see docs/datasets.md).")
    call = describe_call(f, tuple(args), kwargs, argnums=0, in_dims=in_dims, has_aux=has_aux, batched=batched,
                         floating=False)
    for leaf in call.diff:  # the first argument is passed through too
        call.riders[leaf.index] = Rider(call.leaves[leaf.index], batched=batched)
    call.diff, call.simple, call._signature = [], False, None  # the structure changed: no memo
    device = call.leaves[next(iter(call.riders))].device if call.riders else torch.device("cpu")
    call.fn = module_of_rows(call)
    call.x = torch.arange(call.batch if batched else 1, device=device)
    return call


_HANDLES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, torch.nn.Module]]" = weakref.WeakKeyDictionary()


def module_of_rows(call: Call) -> torch.nn.Module:
    """The model as a module of sample indices: same parameters, buffers, submodules, hooks and
    flags (its ``__dict__`` is the model's), a forward that selects the arguments of the samples
    asked and runs the model's own forward on them. One such module per model and call structure
    (``Call.signature``), so that what jacmode caches per module (problem, plan, coupling verdict,
    probe coverage) serves the next call of a training loop; it reads the arguments of the call in
    progress (:func:`rows_bound`)."""
    model = call.f
    assert isinstance(model, torch.nn.Module)  # params_call checked it
    base = type(model)
    key = call.signature()
    known = _HANDLES.get(model)
    if known is not None and key in known:
        return known[key]
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {"forward": _forward_rows, "__module__": base.__module__,
                                            "__qualname__": base.__qualname__})
        _SUBCLASSES[base] = cls
    h: torch.nn.Module = base.__new__(cls)  # type: ignore[call-overload]
    object.__setattr__(h, "__dict__", model.__dict__)
    try:
        _HANDLES.setdefault(model, {})[key] = h
    except TypeError:  # an unhashable key: a module for this call only
        pass
    return h


@contextlib.contextmanager
def rows_bound(call: Call) -> Iterator[None]:
    """Within: the module of :func:`module_of_rows` reads this call's arguments (and after it, none:
    a finished call's tensors are not kept alive)."""
    h = call.fn
    previous = _ROWS_OF.get(h)
    _ROWS_OF[h] = call
    try:
        yield
    finally:
        if previous is None:
            _ROWS_OF.pop(h, None)
        else:
            _ROWS_OF[h] = previous


def params_layout(call: Call, result: Any, flatten: bool) -> Any:
    """A parameter Jacobian of :func:`params_call` in f's output pytree: (B, Y, P) as it is (Y the
    outputs concatenated); with flatten=False, per output leaf a dict name -> (B, *out_leaf, *param)."""
    if flatten or call.single_output():
        return result
    lead = (result[next(iter(result))].shape[0],) if call.batched else ()
    per_out = []
    for lo, n, s in call._out_blocks():
        per_out.append({name: blk.reshape(*lead, -1, *blk.shape[len(lead) + 1:])[:, lo:lo + n].reshape(
            *lead, *s, *blk.shape[len(lead) + 1:]) if call.batched else blk[lo:lo + n].reshape(*s, *blk.shape[1:])
            for name, blk in result.items()})
    return tree_unflatten(per_out, call.out_spec)
