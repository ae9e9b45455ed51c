"""Parameters of a module called with several arguments: the module of sample rows the probe engine sees.

See the note [Several arguments] in ``_args/__init__.py``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import Tensor
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
        cls = type(base.__name__, (base,), {"forward": _forward_rows, "__module__": base.__module__,
                                            "__qualname__": base.__qualname__})
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
