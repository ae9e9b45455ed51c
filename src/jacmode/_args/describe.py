"""Describe a call: argnums and in_dims checked, f's parameter names, the leaves and riders (:func:`describe_call`).

See the note [Several arguments] in ``_args/__init__.py``.
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten

from .._cache import register
from .call import Call
from .flat import Argnums, Flat, InDims, Leaf, Rider, _fmt, children


_SIGNATURES: "weakref.WeakKeyDictionary[Any, tuple[tuple[str, ...], Optional[bool]]]" = register(
    weakref.WeakKeyDictionary(), "positional parameters of functions")


def _positional(f: Any) -> tuple[tuple[str, ...], Optional[bool]]:
    """(names of f's positional parameters, whether it takes exactly one or fewer; None: unknown),
    from ``inspect.signature`` of f (a module's forward), remembered per function (or module class)."""
    key = type(f) if isinstance(f, torch.nn.Module) else f
    try:  # WeakKeyDictionary.get without its own call (every call of a one-argument form asks)
        hit = _SIGNATURES.data.get(weakref.ref(key))  # type: ignore[attr-defined]
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
    flat: bool = False,
    shared: bool = False,
    as_leaves: bool = False,
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
        flat: a flat function (:class:`Flat`) even for a call of one tensor, which is otherwise
            ``simple`` (f itself): for an f that returns a tuple, list or dict of tensors.
        shared: the differentiated arguments are shared by every sample, as in
            ``vmap(jacrev(f), in_dims=(None, 0))``: their leaves keep their whole shape, B is dim 0
            of the batched riders (at least one), and no flat function is built (the caller runs
            the call as a module of those tensors, which checks their dtypes and devices).
        as_leaves: the engines take the differentiated leaves as a list (:meth:`Call.on_leaves`, the vector
            products): they may differ in dtype and device, and no flat function or input is built.

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
    arg_specs, kw_specs = (children(c) for c in children(spec))
    # leaf index ranges per positional argument
    starts: list[int] = []
    owner: list[int] = []
    for k, a_spec in enumerate(arg_specs):
        starts.append(len(owner))
        owner += [k] * a_spec.num_leaves
    n_pos = len(owner)
    diff: list[Leaf] = []
    diff_specs: dict[int, TreeSpec] = {}
    batch: Optional[int] = None
    lo = 0
    for a in nums:
        a_spec = diff_specs[a] = arg_specs[a]
        a_leaves = leaves[starts[a]:starts[a] + a_spec.num_leaves]
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
            if batched and not shared:
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
            shape = tuple(t.shape[1:]) if batched and not shared else tuple(t.shape)
            size = math.prod(shape)
            diff.append(Leaf(arg=a, index=starts[a] + k, shape=shape, lo=lo, size=size))
            lo += size
    dtypes = {leaves[d.index].dtype for d in diff}
    devices = {leaves[d.index].device for d in diff}
    if not (shared or as_leaves) and (len(dtypes) > 1 or len(devices) > 1):
        raise TypeError(
            f"argnums: the differentiated tensors must share one dtype and device, got {sorted(map(str, dtypes))} on "
            f"{sorted(map(str, devices))}. Convert them, e.g. `t.to(x)`.")
    diff_index = {d.index for d in diff}
    kw_leaf_owner: dict[int, str] = {}
    j = n_pos
    for name, kw_spec in zip(kwargs, kw_specs):
        for _ in range(kw_spec.num_leaves):
            kw_leaf_owner[j] = name
            j += 1
    dims = {j: _in_dim(in_dims, owner[j] if j < n_pos else None, kw_leaf_owner.get(j), names) if batched else None
            for j, t in enumerate(leaves) if j not in diff_index and isinstance(t, Tensor)}
    if shared:  # the samples are the batched riders'
        rows = [j for j, dim in dims.items() if dim == 0]
        if not rows:
            raise ValueError(
                f"in_dims: every argument is broadcast (in_dims={in_dims!r}), so there are no samples to give "
                "per-sample results to. Mark the per-sample argument with 0, e.g. in_dims=(None, 0).")
        sizes = {leaves[j].shape[0] if leaves[j].dim() else None for j in rows}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"in_dims: the batched arguments must share dim 0 (the samples), got shapes "
                f"{[tuple(leaves[j].shape) for j in rows]}. Give the others in_dims=None.")
        batch = int(leaves[rows[0]].shape[0])
    b = batch if batched and batch is not None else 1
    riders: dict[int, Rider] = {}
    for j, dim in dims.items():
        t = leaves[j]
        pos = owner[j] if j < n_pos else None
        if dim == 0:
            where = f"argument {pos}" if pos is not None else f"keyword argument {kw_leaf_owner[j]!r}"
            if t.dim() == 0 or t.shape[0] != b:
                raise ValueError(
                    f"in_dims: {where} is batched along dim 0 with the samples (in_dims=0, vmap's default), but "
                    f"its shape {tuple(t.shape)} has no dim 0 of size B = {b}. Pass in_dims=None for it (broadcast "
                    "to every sample), e.g. in_dims=" + ("(0, None)" if pos is not None else "{'name': None}") + ".")
        riders[j] = Rider(value=t, batched=dim == 0)
    call = Call(f=f, batched=batched, argnums=nums, int_argnums=as_int, has_aux=has_aux, args_spec=spec,
                leaves=leaves, diff=diff, diff_specs=diff_specs, riders=riders, batch=b, names=names, shared=shared)
    if shared or as_leaves:
        return call
    simple = (not flat and len(args) == 1 and not kwargs and len(diff) == 1 and not has_aux and as_int
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
