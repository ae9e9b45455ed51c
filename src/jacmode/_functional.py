"""Functional parameters: a dict name -> tensor in place of a module's own (``functional_call``'s convention).

NOTE: [Functional parameters]
torch.func users hold parameters as a dict (``dict(model.named_parameters())`` detached and
updated by a functional optimiser, one slice of ``torch.func.stack_module_state``, a meta-learner's
fast weights) and evaluate ``functional_call(model, params, x)``. ``wrt=params`` asks for the
derivative of that call with respect to the dict's tensors. It is served by the parameter path of
the module itself, run while the module *holds* the dict's tensors:

* :func:`accepts_params_dict` wraps an entry point: a dict ``wrt`` is validated
  (``_checks.check_param_values``: names of the module's parameters or floating buffers, tensors
  of their shapes, one floating dtype and device), then the call runs inside :func:`bind`, with
  ``wrt`` the list of the dict's names (the result in the dict's order);
* :func:`bind` swaps the dict's tensors into the module's slots with torch's own
  ``_reparametrize_module`` (what ``functional_call`` enters; tied weights follow the dict's
  entry as ``functional_call``'s ``tie_weights=True`` does) and swaps the module's own back on exit,
  also when the call raises. Inside, ``module.weight`` IS the dict's tensor, so everything that
  reads the module -- the selection (``_checks.check_param_selection`` returns the bound tensors,
  in the dict's order), the probe engines' hooks (``_engines/probes.py`` checks that the tensor a
  module holds is the selected one), the generic engines' ``functional_call`` over the flat
  vector -- differentiates the dict's values, and ``create_graph=True`` gives gradients to them.
  Two dict entries that are one tensor object (for names that are not tied in the module) are
  bound as two views, so that each name gets its own columns, as ``jacrev`` over the dict gives;
* caches that key facts by parameter identity would see new tensors at every step of a
  functional optimiser and grow without bound: the repeated-call cache is off for a bound call
  (``_calls.signature``) and the probe coverage is keyed by :func:`selection_key` (names, shapes,
  dtypes, flags and the module's own tensors) with its tensors refreshed per call
  (:func:`refreshed`).

Under ``torch.func.vmap`` over stacked parameters (ensembles) the dict's tensors are vmap's
batched tensors; binding them is what ``functional_call`` does, and the generic engines (the only
ones that run inside transforms) compose with vmap. ``per_sample_grads`` inside a transform runs
torch.func's own ``vmap(grad(...))`` idiom over the bound module (:func:`per_sample_grads_transformed`),
with the result assembled functionally.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar, Union, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.stateless import _reparametrize_module

from . import _checks

F = TypeVar("F", bound=Callable[..., Any])

# id(module) -> stack of the dicts bound to it by jacmode (innermost last)
_BOUND: dict[int, list[dict[str, Tensor]]] = {}


def bound_values(model: Any) -> Optional[dict[str, Tensor]]:
    """The dict name -> tensor that jacmode bound to ``model`` for the current call, or None."""
    stack = _BOUND.get(id(model))
    return stack[-1] if stack else None


@contextlib.contextmanager
def bind(model: nn.Module, values: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """Run a block with ``model`` holding ``values`` in its slots; its own tensors back on exit (see the note).

    Yields the bound tensors by name, in the dict's order (a tensor given for two names bound as two views).
    """
    seen: set[int] = set()
    tied = _tied_names(model)
    held: dict[str, Tensor] = {}
    for name, t in values.items():
        if id(t) in seen and not (tied.get(name) and any(values.get(o) is t for o in tied[name])):
            t = t.view_as(t)  # its own object: its own columns, as jacrev over the dict gives
        seen.add(id(t))
        held[name] = t
    with _reparametrize_module(model, dict(held), tie_weights=True):
        _BOUND.setdefault(id(model), []).append(held)
        try:
            yield held
        finally:
            stack = _BOUND[id(model)]
            stack.pop()
            if not stack:
                del _BOUND[id(model)]


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """name -> the other names of the same tensor in ``model`` (tied weights), for names that have some."""
    by_id: dict[int, list[str]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if t is not None:
            by_id.setdefault(id(t), []).append(name)
    return {n: [o for o in names if o != n] for names in by_id.values() if len(names) > 1 for n in names}


def accepts_params_dict(entry: F) -> F:
    """Let ``entry(f, ..., wrt=...)`` take ``wrt`` as a dict name -> tensor (see the note)."""
    @functools.wraps(entry)
    def wrapper(f: Any, *args: Any, **kwargs: Any) -> Any:
        wrt = kwargs.get("wrt")
        if not isinstance(wrt, dict):
            return entry(f, *args, **kwargs)
        values = _checks.check_param_values(f, wrt)
        with bind(f, values):
            kwargs["wrt"] = list(values)
            return entry(f, *args, **kwargs)

    return cast(F, wrapper)


def selection_key(model: nn.Module, named: Sequence[tuple[str, Tensor]]) -> tuple:
    """What a cached fact about the selected tensors depends on: their identity for a module's own,
    and for a bound call the names, shapes, dtypes, flags and the module's own tensors at those names
    (a new dict at every step of a functional optimiser is the same selection)."""
    values = bound_values(model)
    if values is None:
        return tuple((n, id(p)) for n, p in named)
    return ("bound", tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in named))


def refreshed(cov: Any, named: Sequence[tuple[str, Tensor]]) -> Any:
    """A cached probe ``Coverage`` reading the tensors of this call (a bound call's are new each time)."""
    if cov is None or all(cov.tensors.get(n, p) is p for n, p in named):
        return cov
    import dataclasses

    now = dict(named)
    return dataclasses.replace(cov, tensors={n: now.get(n, t) for n, t in cov.tensors.items()})


def per_sample_grads_transformed(f: Any, x: Any, loss: Callable[..., Tensor], y: Optional[Tensor], wrt: Any,
                                 flatten: bool) -> Union[Tensor, dict[str, Tensor]]:
    """``per_sample_grads`` inside a torch.func transform (vmap over an ensemble's parameters, grad of a
    meta-objective): torch.func's ``vmap(grad(loss . functional_call))`` over the samples, which composes
    with the outer transform, assembled without indexed writes (see the note)."""
    from . import _losses  # noqa: PLC0415 -- _losses imports the products' checks

    _checks.check_function(f)
    opts = _checks.check_product_options(wrt=wrt, chunk_size=None, max_memory=None, flatten=flatten)
    _checks.check_not_arguments(x, "x")
    _checks.check_input(x, wrt="params", batched=True, name="x")
    _checks.check_loss(loss)
    _checks.check_torch_loss(loss, y, "per_sample_grads")
    _checks.check_target(y, x.shape[0])
    selected = _checks.check_param_selection(f, opts.param_names)
    batch = x.shape[0]
    if _losses.is_torch_loss(loss):
        assert y is not None
        loss = _losses.per_sample(cast(nn.Module, loss), f(x), y)

    def one(p: dict[str, Tensor], xb: Tensor, yb: Optional[Tensor]) -> Tensor:
        out = functional_call(f, p, (xb.unsqueeze(0),))
        value = loss(out) if yb is None else loss(out, yb.unsqueeze(0))
        return _checks.check_losses(value, 1).reshape(())

    primal = dict(selected)
    g = vmap(grad(one), in_dims=(None, 0, None if y is None else 0), randomness="different")(primal, x, y)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in primal.values()])
    if not flatten:
        return {n: g[n].to(dtype) for n in primal}
    return torch.cat([g[n].reshape(batch, math.prod(p.shape)).to(dtype) for n, p in primal.items()], dim=1)
