"""Parameters of a module called with several arguments: the module of sample rows the engines see.

See the note [Several arguments] in ``_args/__init__.py``.

NOTE: [Several arguments of a model]
``x`` may be a tuple of the model's positional arguments (``model(x, mask)``), with ``kwargs=``
passed through and ``in_dims=`` saying which tensors are batched with the samples (0, vmap's
default) or broadcast (None), as ``_args.describe_call`` reads them. The products then run on
:class:`Bound`, a module over the same submodules and parameters (same names, same objects) whose
only input is the row index of each sample: ``Bound(idx)`` calls ``model(*args, **kwargs)`` with
every batched tensor indexed by ``idx``. Every engine already takes integer inputs (token ids), so
riders follow the samples everywhere without the engines knowing: through the coupling probe
(which changes a sample's index to another sample's, i.e. its inputs to another sample's), the
per-sample ``vmap(grad)`` (an index under vmap gathers that sample's rows), chunks of samples and
the probes (their hooks read the per-layer inputs of the whole-batch forward).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional, cast

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _guard
from .._cache import register
from .._threads import original
from .call import Call
from .describe import describe_call
from .flat import Rider


# ---- parameters of a module called with several arguments ------------------------------------------
_ROWS_OF: "weakref.WeakKeyDictionary[torch.nn.Module, Call]" = weakref.WeakKeyDictionary()
_SUBCLASSES: "weakref.WeakKeyDictionary[type, type]" = register(weakref.WeakKeyDictionary(),
                                                              "module classes of sample rows")


def _forward_rows(self: torch.nn.Module, rows: Tensor) -> Tensor:
    """forward of :func:`module_of_rows`: the model's own forward on the arguments of samples ``rows``."""
    call = _ROWS_OF.get(original(self))  # a structural clone (_threads.py) reads its original's call
    if call is None:
        raise RuntimeError("jacmode internal error: the module of sample indices of a model of several arguments "
                           "ran outside its call (report this)")
    leaves = list(call.leaves)
    for j, r in call.riders.items():
        if r.batched:
            leaves[j] = r.value.index_select(0, rows.to(r.value.device))
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
    return call.flat_output(out, rows.shape[0] if call.batched else None)


def _call_rows(self: torch.nn.Module, rows: Tensor) -> Tensor:
    """``__call__`` of :func:`module_of_rows`: its forward, without the hooks (they are the model's,
    and run inside the forward on the model's arguments)."""
    return _forward_rows(self, rows)


def _as_model(module: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """An object of ``model``'s class over ``module``'s dictionaries (a structural clone's)."""
    seen = object.__new__(type(model))
    seen.__dict__.update(module.__dict__)
    return seen


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


_HANDLES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, torch.nn.Module]]" = register(
    weakref.WeakKeyDictionary(), "modules of sample rows")


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
        cls = type(base.__name__, (base,), {"forward": _forward_rows, "__call__": _call_rows,
                                            "__module__": base.__module__, "__qualname__": base.__qualname__})
        _SUBCLASSES[base] = cls
    h: torch.nn.Module = base.__new__(cls)  # type: ignore[call-overload]
    object.__setattr__(h, "__dict__", model.__dict__)
    _guard.derived(h, model)
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


# ---- the products (per_sample_grads, ntk, ggn, vector products) of a model of several arguments ----

class Bound(nn.Module):
    """``model(*args, **kwargs)`` as a module of one input, the row indices (b,) of the samples.

    Shares the model's parameters, buffers and submodules (the same dictionaries: same names, same
    objects, functional_call swaps reach the model); see the note [Several arguments of a model].
    """

    def __init__(self, model: nn.Module, call: Call) -> None:
        super().__init__()
        for slot in ("_parameters", "_buffers", "_modules"):
            self.__dict__[slot] = model.__dict__[slot]
        self.training = model.training
        # not a submodule (names stay the model's), and weak: the cache of Bounds is keyed by the model
        self.__dict__["_jm_model"] = weakref.ref(model)
        self.use(call)

    def use(self, call: Call) -> None:
        """Serve the call ``call`` (same structure as the one this Bound was made for)."""
        self.__dict__["_jm_call"] = call
        self.__dict__["_jm_rows"] = [d.index for d in call.diff] + [j for j, r in call.riders.items() if r.batched]

    def release(self) -> None:
        """Drop the call's tensors (the Bound outlives the call in the cache); :meth:`use` serves again."""
        self.__dict__["_jm_call"] = None

    def serves(self, model: nn.Module) -> bool:
        """Whether this Bound still shares ``model``'s dictionaries (a model may replace them)."""
        return all(self.__dict__[s] is model.__dict__[s] for s in ("_parameters", "_buffers", "_modules"))

    def forward(self, idx: Tensor) -> Any:  # noqa: D102
        call: Call = self.__dict__["_jm_call"]
        leaves = list(call.leaves)
        for j in self.__dict__["_jm_rows"]:
            leaves[j] = leaves[j][idx]
        pos, kw = tree_unflatten(leaves, call.args_spec)
        model = self.__dict__["_jm_model"]()
        assert model is not None  # the caller holds it
        if original(self) is not self:  # a structural clone (_threads.py): the model through its dictionaries
            seen = object.__new__(type(model))
            seen.__dict__.update(model.__dict__)
            for slot in ("_parameters", "_buffers", "_modules"):
                seen.__dict__[slot] = self.__dict__[slot]
            model = seen
        return model(*pos, **kw)


# model -> {call signature: Bound}: one Bound per call form, so the caches keyed by the module
# (coupling verdict, probe coverage and its completeness check) hit on the next call
_BOUNDS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, Bound]]" = register(weakref.WeakKeyDictionary(),
                                                                             "models bound to their rows")


def several(x: Any) -> bool:
    """Whether ``x`` is a tuple of a model's positional arguments (not one tensor, not a data set)."""
    return isinstance(x, tuple) and any(isinstance(t, Tensor) for t in tree_flatten(x)[0])


def bind(f: Any, x: Any, kwargs: Optional[dict[str, Any]], in_dims: Any, name: str = "x") -> tuple[Any, Any]:
    """(module, input) for the engines: ``(f, x)`` for one tensor, else ``(Bound, row indices)``."""
    if not several(x) and not kwargs:
        return f, x
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs: expected a dict of keyword arguments for the model, got {type(kwargs).__name__}.")
    if not isinstance(f, nn.Module):
        raise TypeError(
            f"f: several arguments ({name} a tuple, or kwargs) need an nn.Module whose parameters are "
            f"differentiated, got {type(f).__name__}.")
    args = x if isinstance(x, tuple) else (x,)
    call = describe_call(f, args, kwargs, argnums=0, in_dims=in_dims, floating=False)
    dev = call.leaves[call.diff[0].index].device
    forms = _BOUNDS.setdefault(f, {})
    key = call.signature()
    g = forms.get(key)
    if g is None or not g.serves(f):
        if len(forms) >= 8:
            forms.clear()
        g = forms[key] = Bound(f, call)
    else:
        g.use(call)
        if g.training != f.training:
            g.training = f.training
    return g, torch.arange(call.batch, device=dev)


@contextlib.contextmanager
def bound(f: Any, x: Any, kwargs: Optional[dict[str, Any]], in_dims: Any) -> Iterator[tuple[Any, Any]]:
    """:func:`bind` for the block, and :func:`release` after it (also on error)."""
    g, idx = bind(f, x, kwargs, in_dims)
    try:
        yield g, idx
    finally:
        release(g)


def release(g: Any) -> None:
    """Let a cached :class:`Bound` drop the tensors of the call it served (anything else: nothing)."""
    if isinstance(g, Bound):
        g.release()


def bind_pair(f: Any, x1: Any, x2: Any, kwargs: Optional[dict[str, Any]],
              in_dims: Any) -> tuple[Any, Any, Any]:
    """:func:`bind` of two batches of the same call form: one Bound over their rows, two index sets."""
    if x2 is None or (not several(x1) and not several(x2) and not kwargs):
        g, i1 = bind(f, x1, kwargs, in_dims, "x1")
        return g, i1, None
    if several(x1) != several(x2):
        raise TypeError("x2: give x1 and x2 in the same form (both a tensor, or both a tuple of the model's arguments).")
    a1, s1 = tree_flatten(x1 if isinstance(x1, tuple) else (x1,))
    a2, s2 = tree_flatten(x2 if isinstance(x2, tuple) else (x2,))
    if s1 != s2:
        raise ValueError(f"x2: expected the structure of x1 ({s1}), got {s2}.")
    g1, i1 = bind(f, x1, kwargs, in_dims, "x1")
    assert isinstance(g1, Bound)
    call = g1.__dict__["_jm_call"]
    b1 = call.batch
    rows = set(g1.__dict__["_jm_rows"])
    merged = []
    for j, (t1, t2) in enumerate(zip(a1, a2)):
        if j in rows:
            if not isinstance(t2, Tensor) or t2.shape[1:] != t1.shape[1:]:
                raise ValueError(f"x2: argument leaf {j} must be a tensor of per-sample shape {tuple(t1.shape[1:])}.")
            merged.append(torch.cat([t1, t2]))
        else:
            same = t1 is t2 or (isinstance(t1, Tensor) and isinstance(t2, Tensor) and t1.shape == t2.shape
                                and bool(torch.equal(t1, t2))) or (not isinstance(t1, Tensor) and t1 == t2)
            if not same:
                raise ValueError(f"x2: broadcast argument leaf {j} (in_dims=None) must be the same in x1 and x2.")
            merged.append(t1)
    both = tree_unflatten(merged, s1)
    g, idx = bind(f, both, kwargs, in_dims, "x1")
    return g, idx[:b1], idx[b1:]
