"""Functional parameters: a dict name -> tensor in place of a module's own (``functional_call``'s convention).

NOTE: [Functional parameters]
torch.func users hold parameters as a dict (``dict(model.named_parameters())`` detached and
updated by a functional optimiser, one slice of ``torch.func.stack_module_state``, a meta-learner's
fast weights) and evaluate ``functional_call(model, params, x)``. ``wrt=params`` asks for the
derivative of that call with respect to the dict's tensors. It is served by the parameter path of
the module itself, run while a copy of the module *holds* the dict's tensors:

* :func:`accepts_params_dict` wraps an entry point: a dict ``wrt`` is validated
  (``_checks.check_param_values``: names of the module's parameters or floating buffers, tensors
  of their shapes, one floating dtype and device), then the call runs on a structural copy of the
  module (:func:`bound_copy`: kept per model, claimed by one call at a time, brought up to the
  model's state at each claim), inside :func:`bind`, with ``wrt`` the list of the dict's names
  (the result in the dict's order). The user's module never holds the dict's tensors, so a plain
  forward of it in another thread meanwhile computes with its own;
* :func:`bind` swaps the dict's tensors into the copy's slots with torch's own
  ``_reparametrize_module`` (what ``functional_call`` enters; tied weights follow the dict's
  entry as ``functional_call``'s ``tie_weights=True`` does) and swaps the copy's own back on exit,
  also when the call raises. Inside, the copy's ``module.weight`` IS the dict's tensor, so everything that
  reads the module -- the selection (``_checks.check_param_selection`` returns the bound tensors,
  in the dict's order), the probe engines' hooks (``_probes/probes.py`` checks that the tensor a
  module holds is the selected one), the generic engines' ``functional_call`` over the flat
  vector -- differentiates the dict's values, and ``create_graph=True`` gives gradients to them.
  Two dict entries that are one tensor object (for names that are not tied in the module) are
  bound as two views, so that each name gets its own columns, as ``jacrev`` over the dict gives;
* caches that key facts by parameter identity would see new tensors at every step of a
  functional optimiser, miss, and grow without bound. A bound dict's tensors count by their
  place, shape, dtype, device and flag instead: in the repeated-call signature
  (``_profile._walk`` reads ``_state._BOUND``; a hit reads this call's tensors, ``_problem.again``,
  and the cached facts keep none of them) and in the probe coverage's key (:func:`selection_key`, which also names the
  submodules holding them), whose cached coverage reads this call's tensors (:func:`refreshed`).

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
import threading
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar, Union, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten

from . import _checks, _guard, _losses
from ._args import Call, Leaf, _in_dim, check_argnums, check_in_dims, describe_call, parameter_names
from ._args.params import LOOP, FunctionRows, _forward_rows, arguments, batched_leaves, merge_pair, rows_bound, shared_rows
from ._cache import Field, Kind, rng_kept
from ._state import bind, bound_values, preserved_state, used_modules
from ._threads import _ORIGINAL, clone_tree, refresh, touching, transient_hooks
from ._transforms import in_transform, outside, plain

F = TypeVar("F", bound=Callable[..., Any])


def accepts_params_dict(entry: F) -> F:
    """Let ``entry(f, ..., wrt=...)`` take ``wrt`` as a dict name -> tensor (see the note)."""
    routed, products = entry.__name__ in _ROUTED, _PRODUCTS.get(entry.__name__)

    @functools.wraps(entry)
    def wrapper(f: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:  # no wrt, no in_dims: neither a dict nor a routed call (jacobian(f, x))
            return entry(f, *args)
        if routed and routes(f, args, kwargs):  # fn(params, x) with params broadcast
            return functional_call_jacobian(wrapper, f, args, kwargs)
        if products is not None and args and isinstance(args[0], tuple) and routes(f, args[0], kwargs):
            return products(wrapper, f, args, kwargs)  # fn(params, x) in a product
        wrt = kwargs.get("wrt")
        if not isinstance(wrt, dict):
            return entry(f, *args, **kwargs)
        values = _checks.check_param_values(f, wrt)
        with bound_copy(f, values) as copy:
            kwargs["wrt"] = list(values)
            return entry(copy, *args, **kwargs)

    return cast(F, wrapper)


# model -> {number: a structural copy of it} (Memo.copies): what calls with wrt a dict run on
_COPIES = Field("copies", "copies of a model that hold a dict's tensors")
_IN_USE: set[int] = set()  # ids of the copies that calls run on now (changed under _COPYING)
_COPYING = threading.Lock()
MAX_COPIES = 8  # kept per model: threads beyond run on a copy of their own, made per call


@contextlib.contextmanager
def bound_copy(model: nn.Module, values: dict[str, Tensor]) -> Iterator[nn.Module]:
    """A structural copy of ``model`` holding ``values`` in its slots, for the block (see the note).

    The copy (``_threads.clone_tree``: new module objects sharing the model's tensors and
    attributes) is kept per model and claimed by one call at a time, so that what calls find out
    about it (profiles, generated code) serves the next steps of a functional optimiser; at each
    claim it is brought up to the model's present state (``_threads.refresh``), or made anew where
    the model's tree changed shape. The user's model never holds the dict's tensors: a forward of
    it in another thread meanwhile computes with its own."""
    if isinstance(model, FunctionRows):  # jacmode's own slots, in a module this thread claimed
        with bind(model, values):
            yield model
        return
    copy, claimed = _claim(model)
    try:
        with bind(copy, values):
            yield copy
    finally:
        if claimed:
            with _COPYING:
                _IN_USE.discard(id(copy))


def _claim(model: nn.Module) -> tuple[nn.Module, bool]:
    """A copy of ``model`` for one call, up to date, and whether it is a kept one (to release)."""
    kept = _guard.memo(model)
    copies: Optional[dict[int, nn.Module]] = None if kept is None else kept.copies
    with _COPYING:  # a kept copy no call runs on now, claimed
        free = next(((k, c) for k, c in (copies or {}).items() if id(c) not in _IN_USE), None)
        if free is not None:
            _IN_USE.add(id(free[1]))
    if free is not None and refresh(free[1], model):
        return free[1], True
    new = _copy(model)  # none free, or the model's tree changed shape
    if copies is None:
        return new, False
    with _COPYING:  # kept in the stale copy's place, or in a new one while fewer than MAX_COPIES
        if free is not None:
            _IN_USE.discard(id(free[1]))
            slot = free[0]
        elif len(copies) < MAX_COPIES:
            slot = max(copies, default=-1) + 1
        else:
            return new, False
        copies[slot] = new
        _IN_USE.add(id(new))
    return new, True


def _copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` that is the module of its calls: unlike the clones engines make
    of a module for one pass, none of its modules names the user's as its original (a module of
    sample rows made of it reads the call it is bound to), except a copy of a module of sample
    rows itself, which reads the call of the module it copies (``_args/params.py``)."""
    copy = clone_tree(model)
    rows = getattr(type(model), "forward", None) is _forward_rows
    for m in copy.modules():
        if not (rows and m is copy):
            m.__dict__.pop(_ORIGINAL, None)
    return copy


def selection_key(model: nn.Module, named: Sequence[tuple[str, Tensor]]) -> tuple:
    """What a cached fact about the selected tensors depends on: their identity for a module's own,
    and for a bound call the names, the submodules holding them (a layer replaced between calls is
    another selection), shapes, dtypes and flags: a new dict at every step of a functional optimiser
    is the same selection. (A cached fact holds those submodules, so their ids are not reused.)"""
    values = bound_values(model)
    if values is None:
        return tuple((n, id(p)) for n, p in named)

    def owner(name: str) -> int:
        try:
            return id(model.get_submodule(name.rpartition(".")[0]))
        except AttributeError:
            return -1

    return ("bound", tuple((n, owner(n), tuple(p.shape), p.dtype, p.requires_grad) for n, p in named))


def refreshed(cov: Any, named: Sequence[tuple[str, Tensor]]) -> Any:
    """A cached probe ``Coverage`` reading the tensors of this call (a bound call's are new each time)."""
    if cov is None:
        return cov
    now = dict(named)
    if all(n in cov.tensors and cov.tensors[n] is now.get(n) for n in cov.covered):
        return cov
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(cov, tensors={n: now[n] for n in cov.covered if n in now})


def per_sample_grads_transformed(f: Any, x: Any, loss: Callable[..., Tensor], y: Optional[Tensor], wrt: Any,
                                 flatten: bool) -> Union[Tensor, dict[str, Tensor]]:
    """``per_sample_grads`` inside a torch.func transform (vmap over an ensemble's parameters, grad of a
    meta-objective): torch.func's ``vmap(grad(loss . functional_call))`` over the samples, which composes
    with the outer transform, assembled without indexed writes (see the note)."""

    _checks.check_function(f)
    opts = _checks.check_product_options(wrt=wrt, chunk_size=None, max_memory=None, flatten=flatten)
    _checks.check_not_arguments(x, "x")
    _checks.check_input(x, wrt="params", batched=True, name="x")
    _checks.check_devices(f, x)
    _checks.check_loss(loss)
    _checks.check_torch_loss(loss, y, "per_sample_grads")
    _checks.check_target(y, x.shape[0])
    selected = _checks.check_param_selection(f, opts.param_names)
    batch = x.shape[0]
    if _losses.is_torch_loss(loss):  # its per-sample terms, checked on plain values (no bool of a batched one)
        assert y is not None
        out = f(x)
        with outside():
            po, py = _one_slice(plain(out), out.dim()).detach(), _one_slice(plain(y), y.dim()).detach()
            loss = _losses.per_sample(cast(nn.Module, loss), po, py)

    def one(p: dict[str, Tensor], xb: Tensor, yb: Optional[Tensor]) -> Tensor:
        out = functional_call(clone_tree(f), p, (xb.unsqueeze(0),))
        value = loss(out) if yb is None else loss(out, yb.unsqueeze(0))
        return _checks.check_losses(value, 1).reshape(())

    primal: dict[str, Tensor] = dict(selected)
    g = vmap(grad(one), in_dims=(None, 0, None if y is None else 0), randomness="different")(primal, x, y)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in primal.values()])
    if not flatten:
        return {n: g[n].to(dtype) for n in primal}
    return torch.cat([g[n].reshape(batch, math.prod(p.shape)).to(dtype) for n, p in primal.items()], dim=1)


# ---- functional style: f(params, x) with the differentiated arguments broadcast -----------------------
#
# NOTE: [Broadcast parameters]
# ``jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))`` is torch.func's
# ``vmap(jacrev(fn), in_dims=(None, 0))(params, x)``: every differentiated argument is broadcast
# (in_dims None) while another is batched, so each sample gets the Jacobian of its output with
# respect to the shared tensors, a parameter problem. The call is described as every call with
# several arguments is (``_args.describe_call`` with ``shared=True``), and
# :func:`functional_call_jacobian` serves it by the module path above:
#
# * when ``fn`` is ``functional_call(model, params, x)`` in disguise (:func:`_disguised`: one run
#   of fn with fresh leaves for the differentiated tensors shows that fn returns the very tensor
#   that one call ``model(x_in)`` returned, that during that call every fresh leaf sat in one slot
#   of the model and nothing else of the model -- its other slots, tensor attributes, its input
#   x_in -- depended on them), the answer is ``jacobian(model, x_in, wrt={slot: leaf})``: the probe
#   engines fire, as for the module's own parameters. (A forward that reads a tensor fn stored
#   outside the module, in a global, is the one route this check does not see.) Inside torch.func
#   transforms the probes do not run, so the check is skipped there;
# * otherwise fn runs as a module of sample rows (``_args.params.shared_rows``, the note [Several
#   arguments of a model]) whose slots are the differentiated leaves, whose children are the
#   modules fn refers to (their flags, state and dropout are seen) and whose input is the row
#   indices; the call is bound to it for the call's duration (``rows_bound``) and the generic
#   engines serve it. Such a module reads the call in progress, which TorchDynamo's guard does not
#   read, so the call runs in the scope of fn itself (``_guard.scoped_call``: the generation of fn's
#   state, which the module follows).
#
# The result is torch.func's layout (``Call.per_output``, ``Call.per_argnum``): for each output leaf
# of fn, the pytree of the differentiated argument (a tuple of them for a tuple ``argnums``) of blocks
# (B, *out_leaf, *leaf.shape).

_ROUTED = ("jacobian", "plan")


def routes(f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call is in the functional style with broadcast differentiated arguments."""
    if "in_dims" not in kwargs or len(args) < 2:
        return False

    nums, _ = check_argnums(kwargs.get("argnums", 0), len(args))
    check_in_dims(kwargs["in_dims"], len(args))
    names = parameter_names(f)
    dims = [_in_dim(kwargs["in_dims"], a, None, names) for a in nums]
    if all(d is None for d in dims):
        return True
    if any(d is None for d in dims):
        raise ValueError(
            f"in_dims: the differentiated arguments {nums} are broadcast for some and batched for others "
            f"(in_dims={kwargs['in_dims']!r}). Differentiate either the per-sample inputs (in_dims 0) or the "
            "shared tensors (in_dims None) in one call; make two calls for both.")
    return False


def _describe(f: Any, args: tuple[Any, ...], argnums: Any, in_dims: Any) -> Call:
    """The call ``f(*args)`` with broadcast differentiated arguments, described (see the note)."""
    if isinstance(f, nn.Module) or not callable(f):
        _checks.check_function(f)
    call = describe_call(f, tuple(args), argnums=argnums, in_dims=in_dims, floating=False, shared=True)
    for a in call.argnums:  # (in this wording: the entry points' own asks for a real floating dtype)
        mine = [leaf for leaf in call.diff if leaf.arg == a]
        for k, leaf in enumerate(mine):
            t = call.leaves[leaf.index]
            if not t.is_floating_point():
                where = f"argument {a}" + (f" (leaf {k})" if len(mine) > 1 else "")
                raise TypeError(f"{where}: differentiating needs a floating dtype, got {t.dtype}. Convert with "
                                "`.float()`, or leave it out of argnums.")
    return call


def _run(entry: Callable[..., Any], f: Any, fargs: tuple[Any, ...], rest: tuple[Any, ...], kwargs: dict[str, Any],
         tensor_output: bool, layout: Optional[str] = None,
         split: Optional[int] = None) -> tuple[Any, Call, dict[str, int]]:
    """``entry(module, input, *rest, wrt=dict, **kwargs)`` for ``f(*fargs)`` with broadcast differentiated
    arguments (see the note), in the scope of ``f``, with ``flatten=False`` where the result is laid out
    per leaf (``layout``: its blocks, for the errors); and the call, and slot -> leaf index.
    ``split``: the input is two batches, its first ``split`` rows and the rest (``ntk``'s x1 and x2)."""
    kwargs = dict(kwargs)
    argnums, in_dims = kwargs.pop("argnums", 0), kwargs.pop("in_dims")
    _no_layout_options(kwargs, argnums, in_dims, layout)
    if layout is not None:
        kwargs["flatten"] = False
    call = _describe(f, fargs, argnums, in_dims)

    def run(module: nn.Module, x: Tensor, values: dict[str, Tensor]) -> Any:
        inputs = (x,) if split is None else (x[:split], x[split:])
        return entry(module, *inputs, *rest, wrt=values, **kwargs)

    def scoped() -> tuple[Any, dict[str, int]]:
        sample_dims = _spelling(f, call)
        hidden = None
        if sample_dims is None and len(batched_leaves(call)) == 1 and not in_transform():
            hidden = _disguised(f, call)
        if hidden is not None:  # the model itself, on its own input
            model, x_in, slots = hidden
            return run(model, x_in, {slot: call.leaves[j] for slot, j in slots.items()}), slots
        shared_rows(call, used, entry.__name__ if tensor_output else None, sample_dims)
        slots = {f"p{k}": leaf.index for k, leaf in enumerate(call.diff)}
        with rows_bound(call):
            return run(call.fn, call.x, {slot: call.leaves[j] for slot, j in slots.items()}), slots

    # fn may swap the shared tensors into the modules it refers to (functional_call): as a bind of
    # them, so that other threads' calls that read those modules meanwhile run again
    used = used_modules(f)  # (once: the module of rows and the binds both read it)
    with touching([m for m in used if not isinstance(m, FunctionRows)]):
        res, slots = _guard.scoped_call(f, fargs, {}, scoped)
    return res, call, slots


def _meta(v: Any) -> Any:
    if isinstance(v, Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device, v.requires_grad)
    try:
        hash(v)
        return ("value", type(v), v)
    except TypeError:
        return ("id", id(v))


def _structure(call: Call) -> tuple:
    """What a call's structure is to the spelling's cache: its signature (the pytree, which leaves are
    differentiated and batched), and each leaf's whole shape, dtype, device and flag (tensors) or value."""
    return (call.signature(), tuple(_meta(v) for v in call.leaves))


def _no_layout_options(kwargs: dict[str, Any], argnums: Any, in_dims: Any, layout: Optional[str]) -> None:
    if kwargs.get("kwargs") is not None:  # (torch.func's transforms pass no keywords to fn either)
        raise ValueError(f"kwargs: not taken with broadcast differentiated arguments (argnums={argnums!r}, in_dims="
                         f"{in_dims!r}): fn gets the positional arguments only. Bind fn's keyword arguments "
                         "first, e.g. functools.partial(fn, scale=2.0).")
    for bad in ("wrt", "flatten", "has_aux", "out", "batched") if layout is not None else ("wrt",):
        if bad in kwargs:
            said = (f"the result is torch.func's pytree of per-leaf blocks {layout}, with respect to the arguments "
                    "argnums names" if layout is not None else
                    "the result is taken with respect to the arguments argnums names, in the order of their leaves")
            raise ValueError(f"{bad}: not taken with broadcast differentiated arguments (argnums={argnums!r}, "
                             f"in_dims={in_dims!r}): {said}. Drop {bad}=.")


def functional_call_jacobian(entry: Callable[..., Any], f: Any, args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> Any:
    """``entry(f, *args, argnums=, in_dims=, ...)`` with broadcast differentiated arguments (see the note)."""
    res, call, slots = _run(entry, f, tuple(args), (), kwargs, False, "(B, *out, *leaf.shape)")
    if entry.__name__ == "plan":
        return res
    by_leaf = {j: res[slot] for slot, j in slots.items()}
    if isinstance(call.fn, FunctionRows):
        call.out_spec, call.out_shapes = call.fn.out_spec, call.fn.out_shapes
    else:  # the model's own output, one tensor: blocks (B, *out, *leaf.shape)
        blk, leaf = by_leaf[call.diff[0].index], call.diff[0]
        call.out_spec, call.out_shapes = tree_flatten(blk)[1], [tuple(blk.shape[1:blk.dim() - len(leaf.shape)])]
    single = call.single_output()

    def out_block(lo: int, n_y: int, s_y: tuple[int, ...]) -> Any:
        def block(leaf: Leaf) -> Tensor:
            blk = by_leaf[leaf.index]
            if not single:
                blk = blk.reshape(call.batch, -1, *leaf.shape)[:, lo:lo + n_y]
            return blk.reshape(call.batch, *s_y, *leaf.shape)

        return call.per_argnum(block)

    return call.per_output(out_block)


def functional_per_sample_grads(entry: Callable[..., Any], f: Any, args: tuple[Any, ...],
                                kwargs: dict[str, Any]) -> Any:
    """``per_sample_grads(fn, (params, x), loss, argnums=0, in_dims=(None, 0))``: torch.func's
    ``vmap(grad(lambda p, xb: loss(fn(p, xb))), in_dims=(None, 0))`` layout, (B, *leaf.shape) per leaf."""
    res, call, slots = _run(entry, f, tuple(args[0]), args[1:], kwargs, True, "(B, *leaf.shape)")
    by_leaf = {j: res[slot] for slot, j in slots.items()}
    return call.per_argnum(lambda leaf: by_leaf[leaf.index])


def functional_ntk(entry: Callable[..., Any], f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ntk(fn, (params, x1), (params, x2), argnums=0, in_dims=(None, 0))`` (and ``ntk_plan``): the
    kernel of torch.func's ``fnet_single(params, x)`` over the leaves argnums names (see the note),
    x1's and x2's samples run as one batch of rows split in two."""
    kwargs = dict(kwargs)
    x1, x2 = args[0], args[1] if len(args) > 1 else kwargs.pop("x2", None)
    if x2 is None:
        return _run(entry, f, tuple(x1), args[2:], kwargs, True)[0]
    if not isinstance(x2, tuple):
        raise TypeError(f"x2: give x1 and x2 in the same form, both a tuple of fn's arguments; got x2 a "
                        f"{type(x2).__name__}.")
    _no_layout_options(kwargs, kwargs.get("argnums", 0), kwargs["in_dims"], None)
    first = _describe(f, tuple(x1), kwargs.get("argnums", 0), kwargs["in_dims"])
    merged = merge_pair(tuple(x1), tuple(x2), set(batched_leaves(first)))
    return _run(entry, f, merged, args[2:], kwargs, True, split=first.batch)[0]


def functional_ggn(entry: Callable[..., Any], f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``ggn(fn, (params, x), loss, argnums=0, in_dims=(None, 0))``: the Gauss-Newton matrix of
    torch.func's ``fnet_single(params, x)`` over the leaves argnums names, (P, P) or (P,) with P in
    the order of those leaves (a dict's order)."""
    return _run(entry, f, tuple(args[0]), args[1:], kwargs, True)[0]


# the products that take fn(params, x) as ``entry(fn, (params, x), ..., argnums=, in_dims=)``
_PRODUCTS: dict[str, Callable[..., Any]] = {"per_sample_grads": functional_per_sample_grads, "ntk": functional_ntk,
                                            "ntk_plan": functional_ntk, "ggn": functional_ggn}


def _one_slice(t: Tensor, dim: int) -> Tensor:
    """The first vmap slice of a :func:`plain` tensor (its vmapped dims lead): ``dim`` dims left."""
    while t.dim() > dim:
        t = t[0]
    return t


def _disguised(f: Any, call: Call) -> Optional[tuple[nn.Module, Tensor, dict[str, int]]]:
    """(model, its input, slot name -> leaf index) when ``f`` is
    ``functional_call(model, params, x)`` in disguise (see the note), else None."""
    leaves, diff, batched = call.leaves, [leaf.index for leaf in call.diff], batched_leaves(call)

    roots = [m for m in used_modules(f) if not isinstance(m, FunctionRows)]
    if not roots or isinstance(f, nn.Module) or torch.is_inference_mode_enabled():
        return None  # (inference mode records no graph: the dependence checks below would see nothing)
    fresh = list(leaves)
    for j in diff:
        fresh[j] = leaves[j].detach().requires_grad_(True)
    mine = {id(fresh[j]): j for j in diff}
    seen: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any, dict[str, int], list[Tensor]]] = []

    def hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], out: Any) -> None:
        slots: dict[str, int] = {}
        others: list[Tensor] = []
        for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
            if t is None:
                continue
            if id(t) in mine:
                slots[name] = mine[id(t)]
            elif t.grad_fn is not None:
                others.append(t)
        for m in module.modules():
            others += [v for v in vars(m).values() if isinstance(v, Tensor) and v.grad_fn is not None]
        seen.append((module, a, kw, out, slots, others))

    me = threading.get_ident()  # the hooks record this thread's call of f, not another thread's forward
    with transient_hooks():  # no guard is traced while these hooks are on the user's modules
        handles = [m.register_forward_hook(lambda *a, **k: hook(*a, **k) if threading.get_ident() == me else None,
                                           with_kwargs=True) for m in roots]
        try:
            with preserved_state(f), torch.enable_grad(), rng_kept(leaves[batched[0]].device):
                out = f(*arguments(fresh, call.args_spec))  # (random draws of this check leave the user's stream alone)
        except Exception:  # noqa: BLE001 -- fn fails here as it would anyway: the generic route says how
            return None
        finally:
            for h in handles:
                h.remove()
    if len(seen) != 1:
        return None
    model, a, kw, result, slots, others = seen[0]
    if result is not out or not isinstance(out, Tensor) or kw or len(a) != 1 or not isinstance(a[0], Tensor):
        return None
    x_in = a[0]
    if sorted(slots.values()) != sorted(diff) or len(set(slots.values())) != len(slots):
        return None  # a differentiated tensor not in the model, or in two of its slots
    b = leaves[batched[0]].shape[0]
    if x_in.dim() == 0 or x_in.shape[0] != b or out.dim() == 0 or out.shape[0] != b:
        return None
    probes = [t for t in (x_in, *others) if t.grad_fn is not None]
    if probes:
        with torch.enable_grad():
            grads = torch.autograd.grad([t.sum() for t in probes], [fresh[j] for j in diff], allow_unused=True)
        if any(g is not None for g in grads):
            return None  # the model's input or another of its tensors depends on the differentiated ones
    return model, x_in.detach() if not x_in.requires_grad else x_in, slots


# ---- the per-sample spelling: fn written for one sample, for vmap ---------------------------------
#
# NOTE: [Per-sample spelling]
# torch.func users write fn for one sample and let vmap batch it: ``fn(p, v) = functional_call(net, p,
# (v[None],))[0]``, differentiated as ``vmap(jacrev(fn), in_dims=(None, 0))(p, x)``. jacmode calls every
# function on the whole batch, where such an fn raises torch's shape errors or, worse, returns another
# layout (a batch of one gives (*out) where (1, *out) is meant). :func:`_spelling` reads the spelling
# once per call structure and generation of fn (cached weakly by fn): fn is *batched* when it runs on
# the batch with every output leading with B and still does on another number of samples (the first
# ones repeated); the documented convention wins whenever it holds, so batched functions keep the
# fast engines. Otherwise fn is *per-sample* when ``vmap(fn, in_dims)`` runs (the module of rows then
# evaluates torch.func's ``vmap(fn)``, exactly what torch.func differentiates), or, where vmap has no
# batching rule (RNNs), when fn runs on one sample (the module of rows stacks a loop over the
# samples, ``LOOP``). A fn that runs under neither reading is refused with both errors, instead of
# torch's error of the batched call.

# fn -> {structure of the call: its spelling, (None,) batched, (vmap's in_dims,), or (LOOP,)}
_SPELLINGS = Kind("how functions take the batch")


def _spelling(f: Any, call: Call) -> Any:
    """How ``f`` takes the batch (see the note): None (batched), vmap's in_dims, or LOOP; kept per
    structure under the generation of f's state (else read every call)."""
    key = _structure(call)
    known = _SPELLINGS.get(f, key)
    if known is None:
        known = (_read_spelling(f, call),)
        _SPELLINGS.put(f, key, known)
    return known[0]


def _read_spelling(f: Any, call: Call) -> Any:
    leaves, spec, n = call.leaves, call.args_spec, call.batch
    rows = set(batched_leaves(call))
    first = leaves[min(rows)]
    dims = arguments([0 if j in rows else None for j in range(len(leaves))], spec)

    def follows(out: Any, m: int) -> bool:
        ts = tree_flatten(out)[0]
        return bool(ts) and all(isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == m for t in ts)

    def samples(m: int) -> Any:
        idx = torch.arange(m, device=first.device) % n
        return arguments([v.index_select(0, idx) if j in rows else v for j, v in enumerate(leaves)], spec)

    err: Optional[Exception] = None
    with preserved_state(f), rng_kept(first.device):
        try:
            batched = follows(f(*arguments(leaves, spec)), n)
        except Exception as e:  # noqa: BLE001 -- fn's own error: judged with the per-sample reading below
            batched, err = False, e
        if batched:
            m = 3 if n == 2 else 2
            try:
                if follows(f(*samples(m)), m):
                    return None
            except Exception:  # noqa: BLE001 -- fn does not follow the number of samples
                pass
        try:
            if follows(vmap(f, in_dims=dims, randomness="different")(*arguments(leaves, spec)), n):
                return dims
        except Exception as e:  # noqa: BLE001
            err_v: Exception = e
        else:
            err_v = ValueError("its outputs are not tensors")
        if batched:
            return None  # ran on the batch, if not on another number of samples: the documented reading
        try:
            one = f(*arguments([v[0] if j in rows else v for j, v in enumerate(leaves)], spec))
            if tree_flatten(one)[0] and all(isinstance(t, Tensor) for t in tree_flatten(one)[0]):
                return LOOP
        except Exception:  # noqa: BLE001
            pass
    if err is None:
        return None  # ran on the batch with another leading dim: the batched path's checks say what is wrong
    raise ValueError(
        f"f: runs neither on the whole batch nor on one sample. jacmode calls f on the batch (the batched arguments "
        f"with dim 0 of {n} samples), where it raised {type(err).__name__}: {_short(err)}; read per sample "
        f"(torch.func's vmap over dim 0) it raised {type(err_v).__name__}: {_short(err_v)}. Expected a function of the batch "
        "returning (B, *out) per output, or of one sample as vmap(jacrev(f), in_dims=...) takes it; fix f for one "
        "of the two.") from err


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text if len(text) <= 160 else text[:157] + "..."
