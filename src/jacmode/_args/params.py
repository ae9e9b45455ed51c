"""Modules of sample rows: a model called with several arguments, a function of shared tensors.

See the note [Several arguments] in ``_args/__init__.py``.

NOTE: [Several arguments of a model]
``jacobian(model, x, mask, wrt="params")`` and the products (``per_sample_grads``, ``ntk``, ``ggn``,
the vector products) with ``x`` a tuple of the model's positional arguments (``model(x, mask)``)
take every argument as it is, with ``kwargs=`` passed through and ``in_dims=`` saying which
tensors are batched with the samples (0, vmap's default) or broadcast (None), as
``describe_call`` reads them. The engines then run on the *module of sample rows*
(:func:`module_of_rows`): an object of a subclass of the model's class whose ``__dict__`` is the
model's (same parameters, buffers, submodules, hooks and flags: same names, same objects, and
``functional_call`` swaps reach the model) and whose only input is the row index of each sample:
``rows_module(idx)`` runs the model's own forward with every batched tensor indexed by ``idx``.
Every engine already takes integer inputs (token ids), so the arguments follow the samples
everywhere without the engines knowing: through the coupling probe (which changes a sample's
index to another sample's, i.e. its inputs to another sample's), the per-sample ``vmap(grad)``
(an index under vmap gathers that sample's rows), chunks of samples and the probes (their hooks
read the per-layer inputs of the whole-batch forward). The model's own hooks see the model's
arguments, never the rows, and a structural clone of the module (``_threads.clone_tree``) reads
the call of the module it copies.

The functional style with shared differentiated arguments (``jm.jacobian(fn, params, x, argnums=0,
in_dims=(None, 0))``, the note [Broadcast parameters] in ``_functional.py``) runs on the same kind
of module: a :class:`FunctionRows`, whose slots p0, p1, ... are the shared tensors (each call binds
its own into them, ``_state.bind``), whose children are the modules fn refers to, and whose
forward (the same :func:`_forward_rows`) passes fn the batched tensors of the rows asked and the
slots in place of the shared ones, calling fn as its spelling says (batched, through vmap, or in
a loop over the samples) and checking that its output keeps its structure.

There is one such module per model or function, call structure (``Call.signature``) and output
form (the Jacobian engines get the output flattened into one tensor, the products the model's own
output for their loss; a function's module also by its slots' shapes, the modules it refers to and
its spelling), so that what jacmode caches per module (problem, plan, coupling verdict, probe
coverage) serves the next call of a training loop; their caches follow the generation of the model
or function (``_guard.derived``). The module holds no tensor of a call and no reference to a
function: it reads the call in progress, which :func:`rows_bound` names for the duration of the
call and forgets after it, also on error (a finished call's tensors are not kept alive). A module
that a call in progress reads (an enclosing call's, another thread's) is not handed to another.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, ContextManager, Iterator, Optional, cast

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _guard
from .._cache import Field, register
from .._guard import memo
from .._threads import original
from .call import Call, kept
from .describe import describe_call
from .flat import Rider


_ROWS_OF: "weakref.WeakKeyDictionary[torch.nn.Module, Call]" = weakref.WeakKeyDictionary()
# module of rows -> the thread that picked it and has not bound it yet (module_of_rows, rows_bound)
_CLAIMS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.Thread]" = weakref.WeakKeyDictionary()
_PICKING = threading.Lock()  # picking a module and binding it, for every thread
_SUBCLASSES: "weakref.WeakKeyDictionary[type, type]" = register(weakref.WeakKeyDictionary(),
                                                              "module classes of sample rows")
# model or function -> {(output form, call signature, ...): module of rows} (Memo.rows)
_HANDLES = Field("rows", "modules of sample rows")
MAX_FORMS = 8  # modules of rows kept per model or function (one called in ever new forms starts over)
LOOP = "loop"  # a function of one sample without a vmap batching rule: a loop over the samples


def _forward_rows(self: torch.nn.Module, rows: Tensor) -> Any:
    """forward of every module of sample rows: f on the arguments of samples ``rows`` of the call in
    progress (:func:`rows_bound`), the shared tensors of a function of shared tensors from its slots."""
    call = _ROWS_OF.get(original(self))  # a structural clone (_threads.py) reads its original's call
    if call is None:
        raise RuntimeError("jacmode internal error: a module of sample rows ran outside its call (report this)")
    leaves = list(call.leaves)
    for j, r in call.riders.items():
        if r.batched:
            leaves[j] = r.value.index_select(0, rows.to(r.value.device))
    if call.shared:
        assert isinstance(self, FunctionRows)
        for k, leaf in enumerate(call.diff):
            leaves[leaf.index] = self._parameters[f"p{k}"]
        return self.output(_batched_call(call.f, leaves, call.args_spec, batched_leaves(call), self.sample_dims))
    pos, kw = tree_unflatten(leaves, call.args_spec)
    d = self.__dict__
    if d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]:
        # the model's own hooks (its dictionaries are this module's) see the model's arguments, never the
        # rows: the model is called as itself (a structural clone, _threads.py: an object of the model's
        # class over the clone's dictionaries)
        f = cast(torch.nn.Module, call.f)  # the module of rows is made of a model only
        model = f if original(self) is self else _as_model(self, f)
        out = model(*pos, **kw)
    else:
        out = type(call.f).forward(self, *pos, **kw)  # type: ignore[attr-defined]
    if not call.flat_rows:
        return out
    return call.flat_output(out, rows.shape[0] if call.batched else None)


def _call_rows(self: torch.nn.Module, rows: Tensor) -> Any:
    """``__call__`` of a model's module of rows: its forward, without the hooks (they are the model's,
    and run inside the forward on the model's arguments)."""
    return _forward_rows(self, rows)


def _as_model(module: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """An object of ``model``'s class over ``module``'s dictionaries (a structural clone's)."""
    seen = object.__new__(type(model))
    seen.__dict__.update(module.__dict__)
    return seen


class FunctionRows(torch.nn.Module):
    """The module of sample rows of a function of shared tensors ``fn(params, x)`` (``Call.shared``):
    slots p0, p1, ... are the differentiated leaves, its children the modules fn refers to (their
    flags, state and dropout are seen). It holds no reference to fn: it runs the call in progress."""

    _jacmode_wrapper = True  # its children are the modules fn refers to, which fn itself feeds
    forward = _forward_rows

    def __init__(self, call: Call, modules: list[torch.nn.Module], tensor_output: Optional[str],
                 sample_dims: Any) -> None:
        super().__init__()
        self.tensor_output = tensor_output  # a product's name: fn returns the model's output, one tensor
        self.sample_dims = sample_dims  # fn written for one sample: vmap's in_dims, or LOOP
        for k, leaf in enumerate(call.diff):  # placeholders without storage: each call binds the user's tensors
            t = call.leaves[leaf.index]
            self._parameters[f"p{k}"] = torch.empty(t.shape, dtype=t.dtype, device="meta")  # type: ignore[assignment]
        self.used = torch.nn.ModuleList(modules)
        self.out_spec: Any = None  # fn's output structure, kept from its first evaluation in a state of fn
        self.out_shapes: list[tuple[int, ...]] = []
        self.generation: Optional[int] = None  # that state (_guard.py)

    def output(self, out: Any) -> Tensor:
        """fn's output as one tensor: a single tensor as is, else (b, Y); its structure checked."""
        if self.tensor_output and not isinstance(out, Tensor):
            rest = "; put the rest in the loss" if self.tensor_output == "per_sample_grads" else ""
            raise TypeError(f"f: {self.tensor_output} needs f to return one tensor (the model's output), got "
                            f"{type(out).__name__}. Return the model's output{rest}.")
        outs, spec = tree_flatten(out)
        if not outs or not all(isinstance(t, Tensor) for t in outs):
            raise TypeError(f"f: expected f to return a tensor or a pytree of tensors, got {type(out).__name__}.")
        holder = cast(FunctionRows, original(self))  # (a structural clone keeps what it learns in the module it copies)
        generation = _guard.current(holder)
        if generation is not None and generation != holder.generation:  # fn's state changed: so may its output
            holder.out_spec, holder.out_shapes, holder.generation = None, [], generation
        kept(holder, spec, [tuple(t.shape[1:]) for t in outs])
        if len(outs) == 1 and isinstance(out, Tensor):
            return out
        return torch.cat([t.reshape(t.shape[0], -1) for t in outs], dim=1)


def arguments(leaves: list[Any], spec: Any) -> tuple[Any, ...]:
    """f's positional arguments from the leaves of its call (a call of shared tensors has no keywords)."""
    return tuple(tree_unflatten(leaves, spec)[0])


def _batched_call(fn: Callable[..., Any], leaves: list[Any], spec: Any, batched: list[int], sample_dims: Any) -> Any:
    """fn on the batch: called as is (batched), through vmap (``sample_dims``, vmap's in_dims of a
    function of one sample), or stacked over a loop (LOOP: one without a vmap batching rule)."""
    if sample_dims is None:
        return fn(*arguments(leaves, spec))
    if sample_dims != LOOP:
        return vmap(fn, in_dims=sample_dims, randomness="different")(*arguments(leaves, spec))
    rows = set(batched)
    n = leaves[batched[0]].shape[0]
    outs = [fn(*arguments([v[b] if j in rows else v for j, v in enumerate(leaves)], spec)) for b in range(n)]
    flat = [tree_flatten(o) for o in outs]
    if any(s != flat[0][1] for _, s in flat) or not all(isinstance(t, Tensor) for ls, _ in flat for t in ls):
        raise TypeError(f"f: expected f to return a tensor or a pytree of tensors of one structure for every sample, "
                        f"got {type(outs[0]).__name__}.")
    return tree_unflatten([torch.stack(ts) for ts in zip(*(ls for ls, _ in flat))], flat[0][1])


def batched_leaves(call: Call) -> list[int]:
    """The leaf indices of the batched tensors (the riders with the samples along dim 0)."""
    return [j for j, r in call.riders.items() if r.batched]


def several(x: Any) -> bool:
    """Whether ``x`` is a tuple of a model's positional arguments (not one tensor, not a data set)."""
    return isinstance(x, tuple) and any(isinstance(t, Tensor) for t in tree_flatten(x)[0])


def params_call(f: Any, args: tuple[Any, ...], kwargs: Any, *, in_dims: Any, has_aux: bool,
                batched: bool) -> Call:
    """The call ``model(*args, **kwargs)`` differentiated with respect to the model's parameters.

    Every argument is passed through (batched along dim 0 or broadcast, as ``in_dims`` says). The
    engines get ``call.fn``, the model seen as a function of sample indices (:func:`module_of_rows`)
    returning its output as one tensor, and ``call.x``, the indices 0..B-1 (unbatched: [0]): every
    engine that evaluates a sample, a chunk of samples or a probe on a few selects their arguments
    by the indices it passes, also under vmap. Parameter names, hooks, flags and state are the
    model's own (shared, not copied).
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
    return _rows_call(f, args, kwargs, in_dims=in_dims, has_aux=has_aux, batched=batched, flat=True)


def _rows_call(f: torch.nn.Module, args: tuple[Any, ...], kwargs: Any, *, in_dims: Any, has_aux: bool,
               batched: bool, flat: bool) -> Call:
    """The call ``f(*args, **kwargs)`` described with every argument passed through, and its module
    of sample rows (``call.fn``, returning the output as one tensor if ``flat``, else as the model
    returns it) and row indices (``call.x``)."""
    call = describe_call(f, tuple(args), kwargs, argnums=0, in_dims=in_dims, has_aux=has_aux, batched=batched,
                         floating=False)
    for leaf in call.diff:  # the first argument is passed through too
        call.riders[leaf.index] = Rider(call.leaves[leaf.index], batched=batched)
    call.diff, call.simple, call._signature = [], False, None  # the structure changed: no memo
    call.flat_rows = flat
    call.fn = module_of_rows(call, (), _over_model)
    return _with_rows(call)


def shared_rows(call: Call, modules: list[torch.nn.Module], tensor_output: Optional[str], sample_dims: Any) -> Call:
    """``call`` (of a function of shared tensors, ``Call.shared``) with its module of sample rows
    (``call.fn``, a :class:`FunctionRows` whose slots are the shared tensors) and row indices (``call.x``);
    ``tensor_output``: the name of the product that needs fn's output as one tensor, else None."""
    diff = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in (call.leaves[d.index] for d in call.diff))
    key = (diff, tensor_output, tuple(id(m) for m in modules), str(sample_dims))
    call.fn = module_of_rows(call, key, lambda c: FunctionRows(c, modules, tensor_output, sample_dims))
    return _with_rows(call)


def _with_rows(call: Call) -> Call:
    """``call`` with its row indices ``call.x``: 0..B-1 (unbatched: [0]), where the batched tensors are."""
    riders = sorted(call.riders.values(), key=lambda r: not r.batched)
    device = riders[0].value.device if riders else torch.device("cpu")
    call.x = torch.arange(call.batch if call.batched else 1, device=device)
    return call


def module_of_rows(call: Call, key: tuple, make: Callable[[Call], torch.nn.Module]) -> torch.nn.Module:
    """f of ``call`` as a module of sample indices (``make(call)``), whose forward selects the
    arguments of the samples asked and runs f on them (:func:`_forward_rows`). One such module per
    f, call structure (``Call.signature``), output form (``Call.flat_rows``) and ``key``, so that what
    jacmode caches per module (problem, plan, coupling verdict, probe coverage) serves the next call
    of a training loop; it reads the arguments of the call in progress (:func:`rows_bound`), and one
    in use by a call in progress (an enclosing call, another thread's) is not shared: a new one.

    The module returned is the calling thread's until :func:`rows_bound` binds it (a claim, made
    under one lock with the test that no call reads it): two threads never bind the same module."""
    key = (call.flat_rows, call.signature(), *key)
    kept = memo(call.f)
    forms: Optional[dict[tuple, Any]] = None if kept is None else kept.rows
    me = threading.current_thread()
    with _PICKING:
        try:
            known = forms.get(key) if forms is not None else None
        except TypeError:  # an unhashable key: a module for this call only
            known, forms = None, None
        stale = known is None or (not call.shared and known.__dict__ is not call.f.__dict__)  # a model's new __dict__
        if known is not None and not stale and known not in _ROWS_OF and _free(known, me):
            _CLAIMS[known] = me
            return known
    h = make(call)
    _guard.derived(h, call.f)
    with _PICKING:
        _CLAIMS[h] = me
        if forms is not None and stale:
            if len(forms) >= MAX_FORMS:
                forms.clear()
            forms[key] = h
    return h


def _free(h: torch.nn.Module, me: threading.Thread) -> bool:
    """Whether no other thread holds a claim on ``h`` (one whose thread has ended holds none)."""
    holder = _CLAIMS.get(h)
    return holder is None or holder is me or not holder.is_alive()


def _over_model(call: Call) -> torch.nn.Module:
    """The model as a module of sample indices: same parameters, buffers, submodules, hooks and
    flags (its ``__dict__`` is the model's), an object of a subclass of its class."""
    model = call.f
    assert isinstance(model, torch.nn.Module)  # _rows_call's callers checked it
    base = type(model)
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {"forward": _forward_rows, "__call__": _call_rows,
                                            "__module__": base.__module__, "__qualname__": base.__qualname__})
        _SUBCLASSES[base] = cls
    h: torch.nn.Module = base.__new__(cls)  # type: ignore[call-overload]
    object.__setattr__(h, "__dict__", model.__dict__)
    return h


@contextlib.contextmanager
def rows_bound(call: Call) -> Iterator[None]:
    """Within: the module of sample rows ``call.fn`` reads this call's arguments (and after it,
    none: a finished call's tensors are not kept alive)."""
    h = call.fn
    with _PICKING:
        previous = _ROWS_OF.get(h)
        _ROWS_OF[h] = call
        if _CLAIMS.get(h) is threading.current_thread():
            del _CLAIMS[h]
    try:
        yield
    finally:
        with _PICKING:
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

    def out_block(lo: int, n: int, s: tuple[int, ...]) -> dict[str, Tensor]:
        return {name: blk.reshape(*lead, -1, *blk.shape[len(lead) + 1:])[:, lo:lo + n].reshape(
            *lead, *s, *blk.shape[len(lead) + 1:]) if call.batched else blk[lo:lo + n].reshape(*s, *blk.shape[1:])
            for name, blk in result.items()}

    return call.per_output(out_block)


# ---- the products (per_sample_grads, ntk, ggn, vector products) of a model of several arguments ----

def _products_call(f: Any, x: Any, kwargs: Optional[dict[str, Any]], in_dims: Any, name: str) -> Call:
    """:func:`_rows_call` of ``f(*x, **kwargs)`` for the products: the model's own output, batched."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs: expected a dict of keyword arguments for the model, got {type(kwargs).__name__}.")
    if not isinstance(f, torch.nn.Module):
        raise TypeError(
            f"f: several arguments ({name} a tuple, or kwargs) need an nn.Module whose parameters are "
            f"differentiated, got {type(f).__name__}.")
    return _rows_call(f, x if isinstance(x, tuple) else (x,), kwargs, in_dims=in_dims, has_aux=False,
                      batched=True, flat=False)


@contextlib.contextmanager
def bound(f: Any, x: Any, kwargs: Optional[dict[str, Any]], in_dims: Any,
          name: str = "x") -> Iterator[tuple[Any, Any]]:
    """(module, input) for the engines within the block: ``(f, x)`` for one tensor, else the module
    of sample rows of ``f(*x, **kwargs)`` and the row indices, its call bound (:func:`rows_bound`)."""
    if not several(x) and not kwargs:
        yield f, x
        return
    call = _products_call(f, x, kwargs, in_dims, name)
    with rows_bound(call):
        yield call.fn, call.x


def rebinding(g: Any) -> Callable[[], ContextManager[Any]]:
    """For ``g`` of :func:`bound`, within its block: a context that binds the same call again, for an
    engine that runs ``g`` after the block (a per-sample vjp function); for a model, nothing to bind."""
    call = _ROWS_OF.get(g) if isinstance(g, torch.nn.Module) else None
    return contextlib.nullcontext if call is None else functools.partial(rows_bound, call)


def merge_pair(x1: tuple[Any, ...], x2: tuple[Any, ...], batched: set[int]) -> tuple[Any, ...]:
    """The arguments of one call over the samples of two calls ``f(*x1)`` and ``f(*x2)`` of the same
    form: the leaves numbered in ``batched`` (batched with the samples) concatenated, x1's first;
    every other leaf the same in both (one object, equal tensors, or equal values)."""
    a1, s1 = tree_flatten(x1)
    a2, s2 = tree_flatten(x2)
    if s1 != s2:
        raise ValueError(f"x2: expected the structure of x1 ({s1}), got {s2}.")
    merged = []
    for j, (t1, t2) in enumerate(zip(a1, a2)):
        if j in batched:
            if not isinstance(t2, Tensor) or t2.shape[1:] != t1.shape[1:]:
                raise ValueError(f"x2: argument leaf {j} must be a tensor of per-sample shape {tuple(t1.shape[1:])}.")
            merged.append(torch.cat([t1, t2]))
        else:
            same = t1 is t2 or (isinstance(t1, Tensor) and isinstance(t2, Tensor) and t1.shape == t2.shape
                                and bool(torch.equal(t1, t2))) or (not isinstance(t1, Tensor) and t1 == t2)
            if not same:
                raise ValueError(f"x2: broadcast argument leaf {j} (in_dims=None) must be the same in x1 and x2.")
            merged.append(t1)
    return tuple(tree_unflatten(merged, s1))


@contextlib.contextmanager
def pair_bound(f: Any, x1: Any, x2: Any, kwargs: Optional[dict[str, Any]],
               in_dims: Any) -> Iterator[tuple[Any, Any, Any]]:
    """:func:`bound` of two batches of the same call form: one module over their rows, two index sets."""
    if x2 is None or (not several(x1) and not several(x2) and not kwargs):
        with bound(f, x1, kwargs, in_dims, "x1") as (g, i1):
            yield g, i1, x2
        return
    if several(x1) != several(x2):
        raise TypeError("x2: give x1 and x2 in the same form (both a tensor, or both a tuple of the model's arguments).")
    first = _products_call(f, x1, kwargs, in_dims, "x1")
    merged = merge_pair(x1 if isinstance(x1, tuple) else (x1,), x2 if isinstance(x2, tuple) else (x2,),
                        {j for j, r in first.riders.items() if r.batched})
    with bound(f, merged, kwargs, in_dims, "x1") as (g, idx):
        yield g, idx[:first.batch], idx[first.batch:]
