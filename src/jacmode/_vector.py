"""jvp, vjp, hvp, linearize and the Gauss-Newton-vector product: products without the Jacobian.

The fronts validate every argument once (errors name it), describe the call with ``_args``
(``describe_call(..., as_leaves=True)``: f as a function of the list of its differentiated leaves,
:meth:`Call.on_leaves`; for parameters, the functional call of the model at the selected tensors)
and restore torch.func's layout; the engines are in ``_autodiff/vector.py`` (see its note
[Vector products]).

Conventions (docs/products.md, "Vector products"):
* wrt="inputs": torch.func's. ``primals`` is f's positional arguments (a tensor or a tuple of
  tensors / pytrees), ``tangents`` has their structure; the products are of the whole call, so
  for a batch of independent samples row b of J v is J_b v_b, and row b of J^T u is u_b^T J_b.
* wrt="params" (all trainable parameters of a module), a list of names, or a dict of tensors
  (functional parameters, called with ``functional_call``): ``primals`` is the model's input (a
  tensor or a tuple of its positional arguments, with ``kwargs=``); parameter vectors are a
  dict name -> tensor or one flat (P,) tensor in ``named_parameters()`` order, and results come
  back in the form given (a dict for dicts and for ``flatten=False``).
* Results carry no autograd graph unless ``create_graph=True`` (then they are differentiable
  with respect to the inputs, tangents and, for wrt="params", the parameters). Inside torch.func
  transforms the calls are torch.func's own and follow the transforms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from . import _guard
from . import _threads
from ._threads import clone_tree
from . import _checks, _losses
from ._coupling import probe
from ._autodiff import vector as _eng
from ._args import Call, describe_call
from ._args.flat import _fmt, children
from ._args.params import bound, rebinding
from ._autodiff.bags import holds_bags, primitive_bags
from ._problem import _has_random_layers
from ._rules.embedding import forward_gap
from ._state import preserved_state
from ._transforms import in_transform
from ._coupling import PRODUCT_WAYS_OUT

Vector = Union[Tensor, dict[str, Tensor]]

HVP_WAYS_OUT = (
    "Ways out: call model.eval() if training-mode statistics are not what you want to "
    "differentiate; pass batched=False for the Hessian-vector product of one scalar f(x) over the whole "
    "batch; or, if you know the samples are independent and the probe is misled, pass "
    "structure='independent' to skip the check."
)
VJP_WAYS_OUT = (
    "Ways out: call model.eval() if training-mode statistics are not what you want to "
    "differentiate; or pass per_sample=False for the whole-batch product u^T J (P,), which needs no "
    "independence."
)


# ---- arguments --------------------------------------------------------------------------------
def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} ({_fmt(value)}).")
    return value


def _check_chunk(chunk_size: Any) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int or None, got {_fmt(chunk_size)}.")


def _kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs: expected a dict of keyword arguments for f, got {type(kwargs).__name__} "
                        f"({_fmt(kwargs)}).")
    return kwargs


def _as_args(primals: Any, name: str = "primals") -> tuple[Any, ...]:
    """f's positional arguments: a tuple as given, anything else as the one argument."""
    if isinstance(primals, tuple):
        if not primals:
            raise ValueError(f"{name}: expected at least one argument of f, got an empty tuple.")
        return primals
    return (primals,)


def _inputs_call(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], has_aux: bool) -> Call:
    """``f(*args, **kwargs)`` differentiated in every tensor of ``args`` (``primals``, checked here)."""
    leaves, spec = tree_flatten(args)
    if not leaves:
        raise ValueError(f"primals: holds no tensors ({_fmt(args)}).")
    for i, t in enumerate(leaves):
        where = "primals" if len(leaves) == 1 else f"primals (leaf {i})"
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: expected a tensor or a pytree (tuple, list, dict) of tensors, got "
                            f"{type(t).__name__} ({_fmt(t)}). Pass the other arguments through kwargs= or a closure.")
        if not t.is_floating_point():
            raise TypeError(f"{where}: differentiating needs a real floating dtype, got {t.dtype}. Convert with "
                            "`.float()`, or pass integer arguments (token ids, masks) through kwargs= or a closure.")
    nums = tuple(k for k, arg in enumerate(children(spec)) if arg.num_leaves)  # every argument holding tensors
    return describe_call(f, args, kwargs, argnums=nums, has_aux=has_aux, batched=False, floating=False,
                         as_leaves=True)


def _like(value: Any, spec: TreeSpec, like: Sequence[Tensor], name: str, of: str) -> list[Tensor]:
    """``value`` flattened, with the structure ``spec`` and the shapes and dtypes of ``like``."""
    leaves, got = tree_flatten(value)
    if got != spec:
        raise ValueError(f"{name}: expected the structure of {of} ({spec}), got {got}. Give one tensor per "
                         f"tensor of {of}, nested the same way.")
    for i, (t, p) in enumerate(zip(leaves, like)):
        where = name if len(leaves) == 1 else f"{name} (leaf {i})"
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: expected a tensor, got {type(t).__name__} ({_fmt(t)}).")
        if t.shape != p.shape:
            raise ValueError(f"{where}: expected shape {tuple(p.shape)} (that of {of}), got {tuple(t.shape)}.")
        if t.dtype != p.dtype or t.device != p.device:
            raise TypeError(f"{where}: expected dtype {p.dtype} on {p.device} (that of {of}), got {t.dtype} on "
                            f"{t.device}. Convert with `.to({of})`.")
    return leaves


def _wrt_kind(wrt: Any) -> str:
    if isinstance(wrt, dict):
        return "dict"
    if isinstance(wrt, str):
        if wrt not in ("inputs", "params"):
            raise ValueError(f"wrt: expected 'inputs', 'params', a list of parameter names or a dict of parameter "
                             f"tensors, got {wrt!r}.")
        return wrt
    if isinstance(wrt, (list, tuple)) and wrt and all(isinstance(n, str) for n in wrt):
        return "names"
    raise TypeError(f"wrt: expected 'inputs', 'params', a list of parameter names or a dict name -> tensor, got "
                    f"{_fmt(wrt)}.")


def _functional(model: nn.Module, params: dict[str, Tensor], *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)`` at ``params`` (``functional_call`` on a structural clone): the call
    the products with respect to parameters describe, differentiated in ``params``."""
    # an EmbeddingBag in primitives: torch defines neither its forward-mode formula nor its second
    # derivative, which J v (forward, or the transpose of a vjp) and H v need (_autodiff/bags.py)
    with primitive_bags(holds_bags(model)):
        return functional_call(clone_tree(model), params, args, kwargs)


@dataclass
class Params:
    """The differentiated parameters: the model's call at them, and the layout results come back in."""

    model: nn.Module
    call: Call  # _functional(model, {name: tensor}, *args, **kwargs), differentiated in argument 1
    as_dict: bool
    functional: bool  # values are the user's (functional_call), not the module's own

    @property
    def names(self) -> list[str]:
        return list(self.call.diff_specs[1].context)

    @property
    def values(self) -> list[Tensor]:
        return self.call.diff_values()

    @property
    def sizes(self) -> list[int]:
        return [leaf.size for leaf in self.call.diff]

    def primals(self, create_graph: bool) -> list[Tensor]:
        return self.values if create_graph else [v.detach() for v in self.values]

    def vector(self, v: Any, name: str) -> list[Tensor]:
        """A parameter vector: a dict over the names, or one flat (P,) tensor."""
        if isinstance(v, dict):
            names = self.names
            missing = [n for n in names if n not in v]
            extra = [n for n in v if n not in names]
            if missing or extra:
                raise ValueError(f"{name}: expected one tensor per differentiated parameter {names[:4]}"
                                 f"{'...' if len(names) > 4 else ''}; missing {missing[:3]}, unexpected {extra[:3]}.")
            out = [v[n] for n in names]
            for n, t, p in zip(names, out, self.values):
                if not isinstance(t, Tensor) or t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                    got = (f"{type(t).__name__}" if not isinstance(t, Tensor)
                           else f"shape {tuple(t.shape)}, {t.dtype} on {t.device}")
                    raise (TypeError if not isinstance(t, Tensor) or t.shape == p.shape else ValueError)(
                        f"{name}: entry {n!r} must be a tensor of shape {tuple(p.shape)}, {p.dtype} on {p.device} "
                        f"(that parameter's), got {got}.")
            return out
        if isinstance(v, Tensor):
            total = sum(self.sizes)
            if v.shape != (total,):
                raise ValueError(f"{name}: expected a dict name -> tensor or one flat tensor of shape (P,) = ({total},) "
                                 f"(the parameters concatenated in named_parameters() order), got {tuple(v.shape)}.")
            dtype = self.values[0].dtype
            if v.dtype != dtype:
                raise TypeError(f"{name}: expected dtype {dtype} (that of the parameters), got {v.dtype}.")
            return self.parts(v)
        raise TypeError(f"{name}: expected a dict name -> tensor or a flat (P,) tensor of parameter values, got "
                        f"{type(v).__name__} ({_fmt(v)}).")

    def parts(self, flat: Tensor) -> list[Tensor]:
        """A flat (P,) vector as one tensor per parameter, unchecked."""
        return [t.view(leaf.shape) for t, leaf in zip(flat.split(self.sizes), self.call.diff)]

    def join(self, parts: Sequence[Tensor], lead: tuple[int, ...] = ()) -> Vector:
        if self.as_dict:
            return {n: t.reshape(*lead, *leaf.shape) for n, t, leaf in zip(self.names, parts, self.call.diff)}
        return torch.cat([t.reshape(*lead, -1) for t in parts], dim=-1)


def params_of(f: Any, wrt: Any, v: Any, flatten: bool, args: tuple[Any, ...], kwargs: dict[str, Any],
              has_aux: bool = False) -> Params:
    """The selection of ``wrt`` ("params": the trainable ones, or the keys of a dict ``v``) and the call
    ``f(*args, **kwargs)`` differentiated in it."""
    kind = _wrt_kind(wrt)
    if not isinstance(f, nn.Module):
        raise TypeError(f"f: wrt={'a dict' if kind == 'dict' else repr(wrt)} differentiates a module's parameters, "
                        f"got {type(f).__name__}. Pass the nn.Module, or use wrt='inputs' with a function of its "
                        "arguments.")
    _check_flag(flatten, "flatten")
    if kind == "dict":
        if not wrt:  # (as _checks.check_param_values says it for the other entry points)
            raise ValueError("wrt: got an empty dict of parameters. Give at least one name -> tensor, or wrt='params'.")
        known = dict(f.named_parameters()) | dict(f.named_buffers())
        for n, t in wrt.items():
            if n not in known:
                raise ValueError(f"wrt: {n!r} is not a parameter or buffer of {type(f).__name__} (e.g. "
                                 f"{list(known)[:4]}).")
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise TypeError(f"wrt: {n!r} must be a floating tensor, got {type(t).__name__}.")
        selected, as_dict = dict(wrt), True
    else:
        names: Optional[Sequence[str]] = list(wrt) if kind == "names" else None
        if kind == "params" and isinstance(v, dict):
            names = list(v)
        selected, as_dict = dict(_checks.check_param_selection(f, names)), isinstance(v, dict) or not flatten
    call = describe_call(_functional, (f, selected, *args), kwargs, argnums=1, has_aux=has_aux, batched=False,
                         floating=False, as_leaves=True)
    return Params(f, call, as_dict, kind == "dict")


# ---- jvp --------------------------------------------------------------------------------------
@_guard.entry(_guard.primals)
def jvp(f: Callable[..., Any], primals: Any, tangents: Any, *, wrt: Any = "inputs", has_aux: bool = False,
        kwargs: Optional[dict[str, Any]] = None, create_graph: bool = False) -> tuple[Any, ...]:
    """Jacobian-vector product J v without the Jacobian, as ``torch.func.jvp``.

    Forward mode over the whole batch (one pass, about 2-3 forward passes of work); where an op has
    no forward formula, the transpose of a vjp (two reverse passes). For independent samples row b
    of the result is J_b v_b.

    Args:
        f: the function; for wrt="params" the ``nn.Module``.
        primals: f's positional arguments: a tensor, or a tuple of tensors / pytrees of tensors
            (wrt="inputs": all differentiated). For wrt="params", the model's input(s).
        tangents: wrt="inputs": the structure, shapes and dtypes of ``primals``. wrt="params": a
            dict name -> tensor (its keys select the parameters) or a flat (P,) tensor.
        wrt: "inputs", "params" (trainable parameters), a list of names, or a dict name -> tensor
            of functional parameters (f called with ``functional_call``).
        has_aux: f returns (output, aux); aux is returned as the third entry.
        kwargs: keyword arguments of f, passed through.
        create_graph: keep the results differentiable (see the module docstring).

    Returns:
        ``(out, jvp_out)`` (and ``aux``), both shaped like f's output, e.g. (B, *out).

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> x, v = torch.randn(5, 3), torch.randn(5, 3)
        >>> out, jv = jm.jvp(net, x, v)                  # row b: J_b v_b
        >>> ref = torch.func.jvp(net, (x,), (v,))[1]
        >>> torch.allclose(jv, ref, atol=1e-6)
        True
        >>> P = sum(p.numel() for p in net.parameters())
        >>> jm.jvp(net, x, torch.randn(P), wrt="params")[1].shape   # J_b v for every sample
        torch.Size([5, 2])
    """
    _checks.check_function(f)
    _check_grad_mode("jvp")
    _check_flag(has_aux, "has_aux")
    _check_flag(create_graph, "create_graph")
    kw = _kwargs(kwargs)
    args = _as_args(primals)
    if _wrt_kind(wrt) == "inputs":
        call = _inputs_call(f, args, kw, has_aux)
        values = call.diff_values()
        tans = _like(_as_args(tangents, "tangents") if isinstance(primals, tuple) else (tangents,),
                     children(call.args_spec)[0], values, "tangents", "primals")
        route = _eng.jvp_any
    else:
        sel = params_of(f, wrt, tangents, True, args, kw, has_aux)
        call, values, tans, route = sel.call, sel.values, sel.vector(tangents, "tangents"), _jvp_route(sel)
    if in_transform():
        return _threads.jvp(lambda *p: call.at(p), tuple(values), tuple(tans), has_aux=has_aux)
    with preserved_state(f):  # also a model behind a lambda: BatchNorm's running statistics stay
        outs, jv, aux = route(call.on_leaves, values if create_graph else [t.detach() for t in values],
                              tans if create_graph else [t.detach() for t in tans], create_graph)
    res = (tree_unflatten(outs, call.out_spec), tree_unflatten(jv, call.out_spec))
    return (*res, aux) if has_aux else res


def _jvp_route(sel: Params) -> Callable[..., tuple[list[Tensor], list[Tensor], Any]]:
    """J v over parameters: forward mode, or the reverse route where forward mode runs but is not exact
    for a selected parameter (torch's forward formula of embedding ignores padding_idx)."""
    return _eng.jvp_reverse if forward_gap(sel.model, sel.names) is not None else _eng.jvp_any


def _check_grad_mode(what: str) -> None:
    """The vector products record autograd graphs (or dual tensors), which torch.inference_mode() turns off."""
    if torch.is_inference_mode_enabled() and not in_transform():
        raise ValueError(f"{what}: runs autograd (a recorded forward pass, dual tensors), which "
                         "torch.inference_mode() switches off, so its products would be zeros or torch's errors. "
                         "Call it outside inference_mode (torch.no_grad() is fine).")


# ---- vjp --------------------------------------------------------------------------------------
@_guard.entry()
def vjp(f: Callable[..., Any], *primals: Any, wrt: Any = "inputs", has_aux: bool = False,
        per_sample: Optional[bool] = None, kwargs: Optional[dict[str, Any]] = None, in_dims: Any = 0,
        flatten: bool = True, create_graph: bool = False, chunk_size: Optional[int] = None) -> tuple[Any, ...]:
    """Vector-Jacobian product u^T J without the Jacobian, as ``torch.func.vjp``.

    One recorded forward pass; each ``vjp_fn(u)`` is one reverse pass. With wrt="params" and
    ``per_sample=True`` (the default there), ``vjp_fn(u)`` gives each sample's row u_b^T J_b
    (B, P): the per-sample gradients of the linear loss u . f(x), by the probe engine (one reverse
    pass and per-layer writes for Linear, convolution, normalisation, embedding layers) and
    ``vmap(grad)`` for other parameters; the samples must be independent (checked once).

    Args:
        f: the function; for wrt="params" the ``nn.Module``.
        *primals: f's positional arguments (wrt="inputs": all differentiated; tensors or pytrees).
        wrt: "inputs", "params", a list of parameter names or a dict of functional parameters.
        has_aux: f returns (output, aux); aux is returned as the third entry.
        per_sample: wrt="params" only: True (default) rows (B, P) per sample, False the sum over
            the batch (P,) as torch.func.
        kwargs: keyword arguments of f, passed through.
        in_dims: wrt="params", per_sample: 0 (batched) or None (broadcast) per positional argument
            of the model (see :func:`jacmode.per_sample_grads`).
        flatten: wrt="params": False gives dicts name -> (B, *shape) / shape.
        create_graph: keep the results differentiable (see the module docstring).
        chunk_size: samples per vectorised pass of the generic per-sample engine.

    Returns:
        ``(out, vjp_fn)`` (and ``aux``). wrt="inputs": ``vjp_fn(u)``, u shaped like f's output,
        returns a tuple with one entry per primal (torch.func's layout). wrt="params": ``vjp_fn(u)``
        returns (B, P) / (P,) or dicts (a dict ``wrt`` always gives dicts).

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> x, u = torch.randn(5, 3), torch.randn(5, 2)
        >>> out, vjp_fn = jm.vjp(net, x, wrt="params")
        >>> rows = vjp_fn(u)                             # (B, P): row b is u_b^T J_b
        >>> J = jm.jacobian(net, x, wrt="params")        # (B, Y, P), only to check
        >>> torch.allclose(rows, torch.einsum("by,byp->bp", u, J), atol=1e-6)
        True
    """
    _checks.check_function(f)
    _check_grad_mode("vjp")
    _check_flag(has_aux, "has_aux")
    _check_flag(create_graph, "create_graph")
    kw = _kwargs(kwargs)
    args = _as_args(primals)
    layout: Callable[[list[Tensor]], Any]  # J^T u in the form of the primals or the parameter vectors
    if _wrt_kind(wrt) == "inputs":
        if per_sample is not None:
            raise ValueError("per_sample: applies to wrt='params'; with respect to the inputs the rows of J^T u are "
                             "already per sample (row b is u_b^T J_b for independent samples). Leave it out.")
        call = _inputs_call(f, args, kw, has_aux)
        if in_transform():
            return torch.func.vjp(lambda *a: f(*a, **kw), *args, has_aux=has_aux)
        spec = children(call.args_spec)[0]
        values, layout = call.diff_values(), lambda grads: tuple(tree_unflatten(grads, spec))
    else:
        per = True if per_sample is None else _check_flag(per_sample, "per_sample")
        sel = params_of(f, wrt, None, flatten, args, kw, has_aux)
        if in_transform():
            return torch.func.vjp(lambda *p: sel.call.at(p), *sel.values, has_aux=has_aux)
        if per:
            if has_aux or create_graph:
                raise ValueError(f"{'has_aux' if has_aux else 'create_graph'}: per-sample products (per_sample=True) "
                                 "return plain (B, P) rows of a model with one tensor output; pass per_sample=False "
                                 "for torch.func's whole-batch vjp, which takes it.")
            engine = _per_sample_engine(sel.model, args, kw, in_dims, sel, chunk_size)
            out = engine.output

            def per_sample_fn(u: Any) -> Vector:
                if not isinstance(u, Tensor) or u.shape != out.shape:
                    raise ValueError(f"u: expected a tensor shaped like f's output {tuple(out.shape)}, got "
                                     f"{tuple(u.shape) if isinstance(u, Tensor) else type(u).__name__}.")
                if u.dtype != out.dtype:
                    raise TypeError(f"u: expected dtype {out.dtype} (that of f's output), got {u.dtype}.")
                return _split_rows(sel, engine(u))

            return out, per_sample_fn
        call, values, layout = sel.call, sel.primals(create_graph), sel.join
    with preserved_state(f):  # as jvp: the model's buffers (BatchNorm's running statistics) stay
        rec = _eng.Recorded(call.on_leaves, values, create_graph)
    out_spec, outs = call.out_spec, rec.outs

    def vjp_fn(u: Any) -> Any:
        return layout(rec.vjp(_like(u, out_spec, outs, "u", "f's output")))

    res = (tree_unflatten(rec.values(), out_spec), vjp_fn)
    return (*res, rec.extra) if has_aux else res


def _split_rows(sel: Params, rows: Tensor) -> Vector:
    if not sel.as_dict:
        return rows
    return sel.join(rows.split(sel.sizes, dim=1), (rows.shape[0],))


def _per_sample_engine(f: nn.Module, args: tuple[Any, ...], kw: dict[str, Any], in_dims: Any, sel: Params,
                       chunk_size: Optional[int]) -> _eng.PerSampleVjp:
    _check_chunk(chunk_size)
    with bound(f, args if len(args) > 1 else args[0], kw or None, in_dims) as (g, x):
        _checks.check_input(x, wrt="params", batched=True)
        with preserved_state(f), torch.no_grad():
            probe(g, x, check=x.shape[0] > 1, ways_out=VJP_WAYS_OUT,
                  validate=lambda out, n: _checks.check_output(out, batched=True, n_in=n))
            named = list(zip(sel.names, sel.values))
            chunk = chunk_size or max(1, min(x.shape[0], 256))
            return _eng.PerSampleVjp(g, x, named, chunk, _has_random_layers(g) or sel.functional,
                                     probes_ok=not sel.functional, bound=rebinding(g))


# ---- hvp --------------------------------------------------------------------------------------
ROUTES = ("auto", "forward", "reverse")


@_guard.entry(_guard.primals)
def hvp(f: Callable[..., Any], primals: Any, tangents: Any, *, wrt: Any = "inputs", loss: Any = None,
        y: Optional[Tensor] = None, kwargs: Optional[dict[str, Any]] = None, batched: bool = True,
        structure: str = "auto", mode: str = "auto", create_graph: bool = False,
        chunk_size: Optional[int] = None) -> Any:
    """Hessian-vector product H v without the Hessian.

    wrt="inputs": f maps x (B, *in) to one scalar per sample, (B,) or (B, 1); the result's row b
    is H_b v_b, the Hessian of sample b's output at x_b times v_b, from one reverse-over-reverse
    pass over the whole batch (samples must be independent: checked once, cached). With
    ``batched=False``, f(x) is one scalar and the result is its Hessian (over all of x) times v.

    wrt="params": the Hessian of a scalar loss in the parameters times v, reverse over reverse
    (``torch.func.jvp(grad(L), ...)``'s numbers to rounding). Either f is a
    module, ``primals`` its input(s) and ``loss`` one of torch's loss modules (its reduction) or a
    callable ``loss(out[, y])`` returning per-sample losses (B,) (summed) or a scalar; or f maps
    a parameter pytree to a scalar (``primals`` the parameters, ``tangents`` shaped like them).

    Args:
        f: the function or model.
        primals: x (B, *in) (wrt="inputs"); the model's input(s) or the parameters (wrt="params").
        tangents: v shaped like x; a parameter vector (a dict or a flat (P,) tensor); or, for a
            function of parameters, a pytree shaped like them.
        wrt: "inputs", "params", a list of parameter names or a dict of functional parameters.
        loss: the loss (wrt="params" with a module). y: its targets.
        kwargs: keyword arguments of f. batched: wrt="inputs": see above.
        structure: "auto" checks that samples are independent; "independent" skips the check.
        mode: "auto" (reverse over reverse, the faster on every size measured here), "forward"
            (forward over reverse: dual tensors through one reverse pass) or "reverse" (the gradient
            of g . v).
        create_graph: keep the result differentiable.
        chunk_size: wrt="inputs" with independent samples: samples per pass (memory: one pass holds
            the forward and reverse graphs of its samples); None, the whole batch at once.

    Returns:
        Shaped like ``tangents`` (a dict for a dict).

    Example:
        >>> import torch, jacmode as jm
        >>> f = lambda x: (torch.sin(x) ** 2).sum(1)       # one scalar per sample
        >>> x, v = torch.randn(4, 3), torch.randn(4, 3)
        >>> hv = jm.hvp(f, x, v)                         # row b: H_b v_b
        >>> torch.allclose(hv, 2 * torch.cos(2 * x) * v, atol=1e-6)
        True
    """
    _checks.check_function(f)
    _check_grad_mode("hvp")
    _check_flag(create_graph, "create_graph")
    _check_flag(batched, "batched")
    if mode not in ROUTES:
        raise ValueError(f"mode: expected one of {ROUTES}, got {_fmt(mode)}.")
    if structure not in ("auto", "independent"):
        raise ValueError(f"structure: expected 'auto' (check that samples are independent) or 'independent' (skip "
                         f"the check), got {_fmt(structure)}.")
    kw = _kwargs(kwargs)
    kind = _wrt_kind(wrt)
    _check_chunk(chunk_size)
    if kind == "inputs":
        if loss is not None or y is not None:
            raise ValueError(f"{'loss' if loss is not None else 'y'}: applies to wrt='params' with a model; with "
                             "respect to the inputs f itself returns the scalars. Write the loss inside f.")
        if not isinstance(primals, Tensor):
            raise TypeError(f"primals: hvp with respect to the inputs takes one tensor x (B, *in), got "
                            f"{type(primals).__name__}. Pass other arguments through kwargs= or a closure.")
        _checks.check_input(primals, wrt="inputs", batched=batched, name="primals")
        (v,) = _like(tangents, tree_flatten(primals)[1], [primals], "tangents", "primals")
        x = primals

        def one(z: Tensor) -> Tensor:
            return f(z, **kw)

        if batched:
            def scalars(shape: Any) -> None:
                if shape not in ((), (1,)):
                    raise ValueError(f"f: hvp with respect to the inputs needs one scalar per sample, f(x) of shape "
                                     f"(B,) or (B, 1), got (B, {', '.join(map(str, shape))}). Reduce the output per "
                                     "sample (e.g. `.sum(1)`), or pass batched=False for one scalar of the whole batch.")

            def validate(out: Any, n: int) -> Tensor:
                out = _checks.check_output(out, batched=True, n_in=n)
                scalars(tuple(out.shape[1:]))
                return out

            with preserved_state(f):
                scalars(probe(one, x, check=structure == "auto" and x.shape[0] > 1, validate=validate, ident=f,
                              ways_out=HVP_WAYS_OUT))

        def scalar(ls: list[Tensor]) -> Tensor:
            out = one(ls[0])
            if not batched and (not isinstance(out, Tensor) or out.numel() != 1):
                raise ValueError(f"f: with batched=False, hvp needs f(x) to be one scalar, got "
                                 f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}.")
            return out.sum()

        if in_transform():
            def scalar_x(z: Tensor) -> Tensor:
                return scalar([z])
            return _threads.jvp(torch.func.grad(scalar_x), (x,), (v,))[1]
        route = "reverse" if mode == "auto" else mode  # measured 1.5-1.9x faster here (docs/products.md)
        with preserved_state(f):
            if not batched or chunk_size is None or chunk_size >= x.shape[0]:
                return _eng.hvp(scalar, [x], [v], route, create_graph)[0]
            return torch.cat([_eng.hvp(scalar, [xc], [vc], route, create_graph)[0]
                              for xc, vc in zip(x.split(chunk_size), v.split(chunk_size))])
    # with respect to parameters
    if not isinstance(f, nn.Module) and kind == "params":
        if loss is not None or y is not None:
            raise ValueError("loss: f is a function of the parameters, so f itself is the loss; pass loss= only with "
                             "a model.")
        call = _inputs_call(f, (primals,), kw, False)
        spec, values = call.diff_specs[0], call.diff_values()
        tans = _like(tangents, spec, values, "tangents", "primals")

        def scalar_p(ls: list[Tensor]) -> Tensor:
            out = call.at(ls)
            if not isinstance(out, Tensor) or out.numel() != 1:
                raise ValueError(f"f: hvp needs f(params) to be one scalar, got "
                                 f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}.")
            return out.reshape(())

        if in_transform():
            def scalar_tree(p: Any) -> Tensor:
                return scalar_p(tree_flatten(p)[0])
            return _threads.jvp(torch.func.grad(scalar_tree), (primals,), (tangents,))[1]
        return tree_unflatten(_eng.hvp(scalar_p, values, tans, "reverse" if mode == "auto" else mode, create_graph),
                              spec)
    args = _as_args(primals)
    sel = params_of(f, wrt, tangents, True, args, kw)
    vs = sel.vector(tangents, "tangents")
    total = _loss_of(loss, y, args)
    gap = forward_gap(sel.model, sel.names)
    if mode == "forward" and gap is not None:
        raise ValueError(f"mode: 'forward' (forward over reverse) is not exact for {gap}. Use mode='auto' or "
                         "'reverse'.")

    def scalar_m(ls: list[Tensor]) -> Tensor:
        return total(sel.call.at(ls))

    with preserved_state(f):
        if in_transform():
            hv = _threads.jvp(torch.func.grad(lambda *p: scalar_m(list(p))), tuple(sel.values), tuple(vs))[1]
        else:
            hv = _eng.hvp(scalar_m, sel.primals(create_graph), vs, "reverse" if mode == "auto" else mode, create_graph)
    return sel.join(list(hv))


def _loss_of(loss: Any, y: Any, args: tuple[Any, ...]) -> Callable[[Tensor], Tensor]:
    """out -> the scalar loss of the batch (torch's module with its reduction, or the sum of per-sample losses)."""
    if loss is None:
        def own(out: Tensor) -> Tensor:
            if not isinstance(out, Tensor) or out.numel() != 1:
                raise ValueError(f"loss: f's output has shape {tuple(out.shape) if isinstance(out, Tensor) else '?'}, "
                                 "not one scalar; pass loss= (torch's loss module with y=, or a callable returning "
                                 "per-sample losses (B,)) for the Hessian of the loss in the parameters.")
            return out.reshape(())
        return own
    _checks.check_loss(loss)
    _checks.check_torch_loss(loss, y, "hvp")
    if _losses.is_torch_loss(loss):
        assert y is not None

        def torch_loss(out: Tensor) -> Tensor:
            return loss(out, y).sum()  # reduction 'none' read as 'sum'
        return torch_loss

    def per_sample(out: Tensor) -> Tensor:
        value = loss(out) if y is None else loss(out, y)
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise TypeError(f"loss: expected a floating tensor (per-sample losses (B,) or a scalar), got "
                            f"{type(value).__name__}.")
        if value.dim() > 1:
            raise ValueError(f"loss: expected per-sample losses (B,) or a scalar, got shape {tuple(value.shape)}.")
        return value.sum()
    return per_sample


# ---- Gauss-Newton-vector product ------------------------------------------------------------
def output_hessian_times(loss: Any, out: Tensor, u: Tensor, y: Optional[Tensor]) -> Tensor:
    """H_b u_b for each sample's output Hessian of ``loss`` (the conventions of :func:`jacmode.ggn`)."""
    if isinstance(loss, str) and loss == "mse":
        return u
    if isinstance(loss, str) and loss == "cross_entropy":
        o, w = (out, u) if out.dim() > 1 else (out.unsqueeze(1), u.unsqueeze(1))
        p = torch.softmax(o, dim=1)
        pu = p * w
        return (pu - p * pu.sum(1, keepdim=True)).reshape(u.shape)
    if _losses.is_torch_loss(loss):
        assert y is not None
        with torch.enable_grad():
            leaf = out.detach().requires_grad_(True)
            g = torch.autograd.grad(loss(leaf, y).sum(), leaf, create_graph=True)[0]
            if not g.requires_grad:
                return torch.zeros_like(u)
            return torch.autograd.grad(g, leaf, u, allow_unused=True)[0]
    n_out = math.prod(out.shape[1:])
    h = _checks.check_hessians(loss(out), out.shape[0], n_out)
    return torch.einsum("byz,bz->by", h.to(u.dtype), u.reshape(u.shape[0], n_out)).reshape(u.shape)


def ggn_vector(f: nn.Module, x: Any, loss: Any, y: Optional[Tensor], v: Any, wrt: Any,
               kwargs: Optional[dict[str, Any]], in_dims: Any) -> Vector:
    """G v = sum_b J_b^T H_b J_b v: one jvp, the loss Hessians, one vjp (see :func:`jacmode.ggn`)."""
    _check_grad_mode("ggn")
    kw = _kwargs(kwargs)
    sel = params_of(f, wrt, v, True, _as_args(x, "x"), kw)
    vs = sel.vector(v, "v")
    with bound(f, x, kw or None, in_dims) as (g, xx):
        return _ggn_vector(f, g, xx, loss, y, sel, vs)


def _ggn_vector(f: nn.Module, g: Any, xx: Tensor, loss: Any, y: Optional[Tensor], sel: Params,
                vs: list[Tensor]) -> Vector:
    _checks.check_input(xx, wrt="params", batched=True)
    _checks.check_ggn_target(loss, y, xx.shape[0])
    with preserved_state(f):
        with torch.no_grad():
            probe(g, xx, check=xx.shape[0] > 1, ways_out=PRODUCT_WAYS_OUT,
                  validate=lambda out, n: _checks.check_output(out, batched=True, n_in=n))
        outs, jv, _ = _jvp_route(sel)(sel.call.on_leaves, sel.primals(False), vs, False)
        if len(outs) != 1:
            raise TypeError("f: ggn needs a model with one tensor output.")
        hjv = output_hessian_times(loss, outs[0], jv[0], y)
        rec = _eng.Recorded(sel.call.on_leaves, sel.primals(False), False)
        return sel.join(rec.vjp([hjv.to(outs[0].dtype)]))


# ---- linearize ------------------------------------------------------------------------------
class Linearized:
    """f linearised at its primals: ``lin(v)`` / ``lin.jvp(v)`` is J v, ``lin.vjp(u)`` is J^T u.

    Built by :func:`jacmode.linearize`. Holds one recorded forward pass (and, after the first
    ``jvp``, the reverse pass J^T u0 with its graph); each application is one backward pass, with
    no checks: arguments must have the shapes of the first call (see docs/products.md).

    Attributes:
        out: f at the primals (shaped like f's output).
    """

    def __init__(self, rec: _eng.Recorded, call: Call, sel: Optional[Params] = None,
                 per_sample: Optional[Callable[[], _eng.PerSampleVjp]] = None) -> None:
        self._rec, self._in, self._outspec, self._sel = rec, children(call.args_spec)[0], call.out_spec, sel
        self._make_rows = per_sample
        self._rows: Optional[_eng.PerSampleVjp] = None
        self.out = tree_unflatten(rec.values(), self._outspec)

    def jvp(self, *tangents: Any) -> Any:
        """J v: ``tangents`` one per primal (wrt="inputs"), or one parameter vector; shaped like f's output."""
        if self._sel is not None:
            (v,) = tangents
            if isinstance(v, dict):
                vs = [v[n] for n in self._sel.names]
            else:
                vs = self._sel.parts(v)
        else:
            vs = tree_flatten(tangents)[0]
        return tree_unflatten(self._rec.jvp(vs), self._outspec)

    __call__ = jvp

    def vjp(self, u: Any) -> Any:
        """J^T u: a tuple with one entry per primal (wrt="inputs"), or per-sample rows (B, P) / the sum (P,)."""
        if self._sel is None:
            return tuple(tree_unflatten(self._rec.vjp(tree_flatten(u)[0]), self._in))
        if self._make_rows is not None:
            if self._rows is None:
                self._rows = self._make_rows()
            return _split_rows(self._sel, self._rows(u))
        return self._sel.join(self._rec.vjp(tree_flatten(u)[0]))


@_guard.entry()
def linearize(f: Callable[..., Any], *primals: Any, wrt: Any = "inputs", kwargs: Optional[dict[str, Any]] = None,
              per_sample: Optional[bool] = None, in_dims: Any = 0, flatten: bool = True,
              create_graph: bool = False) -> Linearized:
    """f linearised at ``primals``, cheap to apply many times (Newton-Krylov, CG): J v and J^T u.

    ``torch.func.linearize``'s ``jvp_fn`` plus the transpose. One forward pass is recorded once;
    each ``lin(v)`` is then one backward pass through the recorded reverse pass (no forward pass,
    no checks, no probes) and each ``lin.vjp(u)`` one backward pass of the forward.

    Args:
        f: the function; for wrt="params" the ``nn.Module``.
        *primals: f's positional arguments (wrt="params": the model's inputs).
        wrt: "inputs", "params", a list of parameter names or a dict of functional parameters.
        kwargs: keyword arguments of f.
        per_sample: wrt="params": ``vjp(u)`` per sample (B, P) (default) or summed (P,).
        in_dims: see :func:`vjp`. flatten: wrt="params": False gives dicts.
        create_graph: keep the products differentiable.

    Returns:
        A :class:`Linearized`: ``lin.out``, ``lin(v)`` = ``lin.jvp(v)``, ``lin.vjp(u)``.

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, v = torch.randn(5, 3), torch.randn(5, 3)
        >>> lin = jm.linearize(net, x)
        >>> torch.allclose(lin(v), _threads.jvp(net, (x,), (v,))[1], atol=1e-6)
        True
        >>> (g,) = lin.vjp(v)                            # J^T v, one tensor per primal
        >>> g.shape
        torch.Size([5, 3])
    """
    _checks.check_function(f)
    _check_grad_mode("linearize")
    _check_flag(create_graph, "create_graph")
    kw = _kwargs(kwargs)
    args = _as_args(primals)
    if _wrt_kind(wrt) == "inputs":
        if per_sample is not None:
            raise ValueError("per_sample: applies to wrt='params'. Leave it out.")
        call = _inputs_call(f, args, kw, False)
        with preserved_state(f):
            rec = _eng.Recorded(call.on_leaves, call.diff_values(), create_graph)
        return Linearized(rec, call)
    sel = params_of(f, wrt, None, flatten, args, kw)
    with preserved_state(f):
        rec = _eng.Recorded(sel.call.on_leaves, sel.primals(create_graph), create_graph)
    per = True if per_sample is None else _check_flag(per_sample, "per_sample")

    def rows() -> _eng.PerSampleVjp:
        return _per_sample_engine(sel.model, args, kw, in_dims, sel, None)

    return Linearized(rec, sel.call, sel, rows if per else None)
