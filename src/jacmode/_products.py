"""The entry points per_sample_grads, ntk, ntk_plan and ggn: what users build from Jacobians.

Each validates, checks that samples are independent (``_coupling``), keeps the model as found
(``_state``), then runs a per-layer engine where the selected parameters live in covered layers
(``_probes/layerio.py``) or the generic one otherwise (see ``_probes/products.py`` and
``_probes/ntk.py``). ``x`` may be a tuple of the model's positional arguments (see the note
[Several arguments of a model] in ``_args/params.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence, Union, cast

import torch
from torch import Tensor, nn

from . import _guard
from . import _checks, _data, _losses, _profile
from ._checks import Options, Wrt
from ._coupling import PRODUCT_WAYS_OUT, probe
from ._probes import layerio, probes
from ._probes import ntk as _ntk
from ._probes import products as _engine
from ._autodiff.fallback import classify
from ._probes.layerwise import columns
from ._args.params import bound, pair_bound, several
from ._functional import accepts_params_dict, per_sample_grads_transformed
from ._jacobian import jacobian
from ._state import bound_values
from ._planning import ntk as _ntk_plan
from ._planning.footprint import footprint
from ._planning import memory as _memory
from ._problem import _has_random_layers
from ._rules.base import NotCovered
from ._rules.embedding import forward_gap
from ._state import preserved_state
from ._transforms import in_transform
from ._vector import ggn_vector

Memory = Optional[Union[int, float, str]]


PRODUCT_WHY = "its engines record layer inputs with forward hooks and build the product outside autograd"
PRODUCT_INSTEAD = ("inside a transform, use jm.jacobian(f, x, wrt='params'), which follows the transform, "
                   "and form the product from its (B, Y, P) rows.")


def _setup(f: Any, x: Any, wrt: Wrt, chunk_size: Any, max_memory: Any, flatten: Any = True, name: str = "x",
           product: str = "per_sample_grads") -> tuple[Options, list[tuple[str, nn.Parameter]]]:
    opts = _checked(f, x, wrt, chunk_size, max_memory, flatten, name, product)
    return opts, _selected(f, x, opts)


def _checked(f: Any, x: Any, wrt: Wrt, chunk_size: Any, max_memory: Any, flatten: Any = True, name: str = "x",
             product: str = "per_sample_grads") -> Options:
    """The checks of a product's call that a profile hit makes too: f, the options, the input."""
    _checks.check_function(f)
    _checks.check_outside_transforms(product, PRODUCT_WHY, PRODUCT_INSTEAD)
    opts = _checks.check_product_options(wrt=wrt, chunk_size=chunk_size, max_memory=max_memory, flatten=flatten)
    _checks.check_not_arguments(x, name)
    _checks.check_input(x, wrt="params", batched=True, name=name)
    return opts


def _selected(f: Any, x: Any, opts: Options) -> list[tuple[str, nn.Parameter]]:
    """The devices checked and the parameters selected: what a profile hit of per_sample_grads
    holds already (its key names the devices and the selection)."""
    _checks.check_devices(f, x)
    return _checks.check_param_selection(f, opts.param_names)


def _out_shape(f: Any, x: Tensor) -> tuple[int, ...]:
    return probe(f, x, check=x.shape[0] > 1, ways_out=PRODUCT_WAYS_OUT,
                 validate=lambda out, n: _checks.check_output(out, batched=True, n_in=n))


def _jacobian_of(f: nn.Module, names: Sequence[str], max_memory: Any) -> Callable[[Tensor], Tensor]:
    """The (b, Y, P) per-sample Jacobian of ``f``'s parameters ``names`` at b samples, for the engines
    that build a product from Jacobian blocks (``_probes/ntk.py``, ``ggn_generic``)."""
    def block(xs: Tensor) -> Tensor:
        return cast(Tensor, jacobian(f, xs, wrt=list(names), max_memory=max_memory))

    return block


def _chunk(opts: Options, per_sample_bytes: int, batch: int, budget: int) -> int:
    """Samples per pass of a generic engine: ``chunk_size``, else as many as fit the workspace ``budget``
    (``memory.budget``: on top of the result)."""
    if opts.chunk_size is not None:
        return opts.chunk_size
    return max(1, min(batch, budget // max(1, 4 * per_sample_bytes)))


@accepts_params_dict
@_guard.entry(_guard.first_input)
def per_sample_grads(
    f: nn.Module, x: Tensor, loss: Callable[..., Tensor], *, y: Optional[Tensor] = None,
    wrt: Wrt = "params", flatten: bool = True, chunk_size: Optional[int] = None, max_memory: Memory = None,
    progress: Optional[bool] = None, kwargs: Optional[dict[str, Any]] = None, in_dims: Any = 0,
) -> Union[Tensor, dict[str, Tensor]]:
    """Gradient of each sample's loss with respect to the parameters, without the (B, Y, P) Jacobian.

    For parameters of layers with a per-module rule (Linear, convolutions, normalisations,
    Embedding), one forward and one reverse pass give each layer's input a and loss cotangent g per
    sample, and for a Linear layer sample b's weight gradient is g_b (x) a_b (Opacus's method); the
    other parameters' columns come from ``vmap(grad)`` of the per-sample loss.

    Args:
        f: the model, an ``nn.Module`` mapping x (B, *in) to (B, *out).
        x: the batch, shape (B, *in), any dtype (token ids too); samples must be independent. Or a
            data set (a DataLoader or another iterable of x or (x, y) batches, y then taken from
            it): rows in order. A tuple or list holding tensors is neither and raises a TypeError
            (see docs/datasets.md).
        loss: ``loss(out)``, or ``loss(out, y)`` when ``y`` is given, mapping f(x) (B, *out) to
            per-sample losses (B,) (no reduction over the batch). Or one of torch's loss modules
            (``nn.MSELoss``, ``nn.CrossEntropyLoss``, ``nn.BCEWithLogitsLoss``, ``nn.NLLLoss``,
            ``nn.L1Loss``, ``nn.HuberLoss``, ``nn.SmoothL1Loss``, ``nn.BCELoss``), any
            ``reduction``, with ``y``: row b is then the gradient of sample b's term of torch's
            batch loss, so the rows sum to its gradient (for reduction='mean' that includes
            torch's 1/N; reduction='none' is read as 'sum'; see docs/products.md).
        y: targets, one row per sample, passed to ``loss``.
        wrt: "params", a list of parameter names (a subset), or a dict name -> tensor (the
            module at those values, as ``functional_call``; see docs/functional.md).
        flatten: False returns a dict name -> (B, *param.shape).
        chunk_size: samples per vectorised pass of the generic engine.
        max_memory: workspace budget on top of the result, in bytes or as "2GB", as in
            :func:`jacmode.jacobian` (docs/memory.md); the result itself must fit the free memory.
        progress: for a data set, None shows a progress bar on a terminal, True always, False never.
        kwargs: keyword arguments of the model, passed through (not differentiated).
        in_dims: with x a tuple of the model's positional arguments (``model(x, mask)``), how each
            tensor is treated: 0 batched with the samples (default), None broadcast; for all, per
            argument (a tuple) or by name (a dict), as ``torch.func.vmap``'s ``in_dims``.

    Returns:
        (B, P), the parameters flattened and concatenated in ``named_parameters()`` order, in
        the parameters' dtype (promoted where they differ), whatever x's dtype (token ids).

    Raises:
        MemoryError: the result is larger than the free memory, before anything is allocated.

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> x, y = torch.randn(5, 3), torch.randn(5, 2)
        >>> g = jm.per_sample_grads(net, x, lambda out, y: ((out - y) ** 2).sum(1), y=y)
        >>> g.shape                                   # (B, P), P = 3*8 + 8 + 8*2 + 2
        torch.Size([5, 50])
        >>> total = torch.autograd.grad(((net(x) - y) ** 2).sum(), list(net.parameters()))
        >>> torch.allclose(g.sum(0), torch.cat([t.reshape(-1) for t in total]), atol=1e-5)
        True
    """
    if kwargs or not isinstance(x, Tensor):  # (one tensor: neither of these)
        if several(x) or kwargs:  # model(*x, **kwargs): see the note [Several arguments of a model]
            with bound(f, x, kwargs, in_dims) as (g, idx), preserved_state(f):
                return per_sample_grads(g, idx, loss, y=y, wrt=wrt, flatten=flatten, chunk_size=chunk_size,
                                        max_memory=max_memory)
        if _data.is_batches(x):  # a data set: batch by batch, rows in order (docs/datasets.md)
            return _data.per_sample_grads_over(per_sample_grads, f, x, loss, y=y, flatten=flatten,
                                               progress=progress, wrt=wrt, chunk_size=chunk_size,
                                               max_memory=max_memory)
    if in_transform():  # vmap over an ensemble's parameters, grad of a meta-objective: torch.func's idiom
        return per_sample_grads_transformed(f, x, loss, y, wrt, flatten)
    if torch.compiler.is_dynamo_compiling():  # inside the user's torch.compile: a traceable path (no profile)
        from ._autodiff import traceable as _traceable

        selected = _selected(f, x, _checked(f, x, wrt, chunk_size, max_memory, flatten))
        _checks.check_loss(loss)
        _checks.check_torch_loss(loss, y, "per_sample_grads")
        _checks.check_target(y, x.shape[0])

        def again() -> Union[Tensor, dict[str, Tensor]]:
            return per_sample_grads(f, x, loss, y=y, wrt=wrt, flatten=flatten, chunk_size=chunk_size,
                                    max_memory=max_memory, progress=progress)

        return _traceable.per_sample_grads(again, f, x, loss, y, [n for n, _ in selected], flatten)
    # ---- profile: the coverage and the split of the parameters, found once per signature ----
    # The key names the options as given, with their types, where they are hashable (then a hit,
    # whose first call validated the same options, f, x's kind and shape, the loss's code or type
    # and reduction, and y's shape, checks nothing again: from its second hit, the profile's "hot"
    # entry holds what those checks and the selection gave), else as validated.
    options: Any = (wrt, chunk_size, max_memory, flatten, type(wrt), type(chunk_size), type(max_memory),
                    type(flatten))  # types: 1 is not True
    opts: Optional[Options] = None
    try:
        hash(options)
    except TypeError:
        opts = _checked(f, x, wrt, chunk_size, max_memory, flatten)
        options = opts
    # x, y, the loss and the options as the call's arguments (no keywords to sort: every call does it)
    loss_key = _loss_key(loss)
    hashable = opts is None  # the key holds the options as given: the last hit's key may be tested in place
    looked = _profile.lookup(f, _PSG_TOKEN, (x, y, loss_key, options))
    modules, key, survey, found = looked.modules, looked.key, looked.survey, looked.found
    hot = None if found is None or bound_values(f) is not None else found.runs.get("hot")
    if hot is not None:  # a repeated call: what the first call found and checked
        opts, selected, names, params, n_params = hot.opts, hot.selected, hot.names, hot.params, hot.n_params
        dtype, torch_loss, rest_names, kernels = hot.dtype, hot.torch_loss, hot.rest_names, hot.kernels
        batch = x.shape[0]
    else:
        if opts is None:
            opts = _checked(f, x, wrt, chunk_size, max_memory, flatten)
        if found is None or bound_values(f) is not None:  # the selection of a hit is the profile's (same key)
            selected = _selected(f, x, opts)
        else:
            selected = found.facts.selected
        _checks.check_loss(loss)
        _checks.check_torch_loss(loss, y, "per_sample_grads")
        _checks.check_target(y, x.shape[0])
        names, params = [n for n, _ in selected], [p for _, p in selected]
        n_params, batch = sum(p.numel() for p in params), x.shape[0]
        dtype = _engine.result_dtype(params)
        torch_loss = _losses.is_torch_loss(loss)
        rest_names, kernels = None, True
        if found is not None and bound_values(f) is None:  # a hit: its facts serve the next hits as they are
            cov = found.facts.coverage
            rest_names = [n for n, _ in selected if cov is None or n not in cov.covered]
            # the probe engine alone (every parameter covered) runs the model under plain autograd,
            # which every attention kernel supports: the guard leaves their flags alone
            # (_state._kernels_in) unless the model holds torch's attention modules (their fast path)
            kernels = bool(rest_names) or any(isinstance(m, _ATTENTION) for m in modules)
            found.runs["hot"] = SampleGradsHot(opts, selected, names, params, n_params, dtype, torch_loss,
                                               rest_names, kernels)
    assert opts is not None  # validated above, or on the first call of a hit's key
    needed = batch * n_params * dtype.itemsize
    budget = _memory.budget(opts.max_memory, x.device, needed)
    if budget is None:  # (the message is formatted only then)
        raise _memory.too_large(needed, x.device, "per_sample_grads: the (B, P) result",
                                f"({batch}, {n_params}) {dtype}", "Pass a smaller batch or fewer parameters (wrt=[...]).")

    def losses(out: Tensor) -> Tensor:
        return _checks.check_losses(loss(out) if y is None else loss(out, y), out.shape[0])

    with preserved_state(f, modules, survey, grad=False, kernels=kernels):  # and no_grad
        if found is None:
            _out_shape(f, x)
        if torch_loss:  # torch's module -> its per-sample terms (see _losses.py)
            assert y is not None
            loss = _losses.per_sample(cast(nn.Module, loss), f(x), y)
        if found is None:
            cov = layerio.usable(f, x, selected)
            if cov is not None and cov.uncovered and _has_random_layers(f):
                cov = None  # two passes would draw two dropout masks
            cols = columns(selected)
            modifies = True
        else:
            entry: SampleGradsEntry = found.facts
            cov, cols, checked, modifies = entry.coverage, entry.columns, entry.checked, entry.modifies
        flat = torch.empty(batch, n_params, dtype=dtype, device=x.device)  # never x's dtype: ids are int
        rest = selected if cov is None else [] if rest_names == [] else [
            (n, p) for n, p in selected if n not in cov.covered]
        if cov is not None:
            # the model runs on x itself where its first call showed that it leaves its input alone
            clone = modifies or not probes.can_skip_clone(x)
            version = None if clone else x._version
            try:
                modifies = _engine.per_sample_grads_layers(f, cov, x, losses, selected, flat, clone=clone)
            except NotCovered:
                rest = selected
                _profile.forget(f, key)
                found = None
            if not clone and x._version != version:
                _profile.forget(f, key)  # the next call runs the model on a copy again
                if rest:
                    raise RuntimeError(
                        "f: the model modified its input x in place during this call of per_sample_grads, unlike "
                        "on the first call with these shapes (jacmode then runs it on x itself), and its "
                        "per-sample gradients cannot be completed from the modified x, which x now holds. Pass a "
                        "copy, per_sample_grads(f, x.clone(), ...), or leave the model's input unmodified.")
        if rest:
            if found is None or not checked:
                head = f(x[:1])
                _checks.check_losses(loss(head) if y is None else loss(head, y[:1]), 1)
            n_rest = sum(p.numel() for _, p in rest)
            _engine.per_sample_grads_generic(f, x, y, loss, rest, cols, flat, _chunk(opts, 4 * n_rest, batch, budget))
        if found is None and not (cov is not None and len(rest) == len(selected) and rest):
            _profile.keep(f, key, _profile.Profile(SampleGradsEntry(cov, cols, bool(rest),
                          selected if bound_values(f) is None else None, modifies)), modules)  # not a dict's tensors
    if hashable and hot is not None and found is not None:
        _profile.served(f, _PSG_TOKEN, looked, x, y, loss_key, options)
    if flatten:
        return flat
    sizes = [p.numel() for p in params]
    return {n: t.reshape(batch, *p.shape) for n, t, p in zip(names, flat.split(sizes, dim=1), params)}


_ATTENTION = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
              nn.TransformerDecoder, nn.Transformer)
_PSG_TOKEN = _profile.token("per_sample_grads", {"options": "in the key's call part"})[0]


@dataclasses.dataclass(frozen=True)
class SampleGradsEntry:
    """What a per_sample_grads call keeps in f's profile for the later calls with its key (``_profile.py``).

    Attributes:
        coverage: the parameters the probe engine covers (``layerio.usable``); None: the generic path alone.
        columns: name -> (first column, number of columns) in the (B, P) result (``layerwise.columns``).
        checked: whether the first call checked the losses of one sample (it ran the generic path).
        selected: the parameters selected, as (name, parameter); None where a dict of tensors was bound in.
        modifies: whether the model may modify its input in place (then it runs on a copy of x).
    """

    coverage: Optional[probes.Coverage]
    columns: dict[str, tuple[int, int]]
    checked: bool
    selected: Optional[list[tuple[str, nn.Parameter]]]
    modifies: bool


@dataclasses.dataclass(frozen=True)
class SampleGradsHot:
    """What a per_sample_grads profile's first hit checked and found, for the later hits (its ``runs["hot"]``).

    Attributes:
        opts: the options, validated.
        selected: the parameters selected, as (name, parameter).
        names: their names, in order.
        params: the parameters, in order.
        n_params: their number of elements, P.
        dtype: the result's dtype (``products.result_dtype``).
        torch_loss: whether the loss is one of torch's loss modules.
        rest_names: the names of the selected parameters that the probe engine does not cover.
        kernels: whether the state guard sets the attention kernels' flags (``_state._kernels_in``).
    """

    opts: Options
    selected: list[tuple[str, nn.Parameter]]
    names: list[str]
    params: list[nn.Parameter]
    n_params: int
    dtype: torch.dtype
    torch_loss: bool
    rest_names: Optional[list[str]]
    kernels: bool


def _loss_key(loss: Any) -> Any:
    """A loss in a profile's key: its code for a Python function (a lambda written in a loop is a
    new object per call, with the same code), its type and reduction for torch's loss modules."""
    code = getattr(loss, "__code__", None)
    if code is not None:
        return code
    if isinstance(loss, nn.Module):
        return (type(loss), getattr(loss, "reduction", None))
    return (type(loss), id(loss))


def _ntk_setup(f: Any, x1: Any, x2: Any, wrt: Wrt, method: Any, trace: Any, chunk_size: Any,
               max_memory: Any) -> tuple[Options, list[tuple[str, nn.Parameter]], int, Any, int, _ntk_plan.NtkPlan]:
    """The checked options, the selection, Y, the layers' coverage, the workspace budget and the plan of ntk."""
    opts, selected = _setup(f, x1, wrt, chunk_size, max_memory, name="x1", product="ntk")
    _checks.check_not_arguments(x2, "x2")
    _checks.check_second_input(x1, x2)
    _checks.check_ntk_method(method, trace)
    params = [p for _, p in selected]
    n_out = math.prod(_out_shape(f, x1))
    if x2 is not None:
        _out_shape(f, x2)
    cov = layerio.usable(f, x1, selected)
    cov = None if cov is None or cov.uncovered else cov
    if method == "structured" and cov is None:
        why = "; ".join(f"{n}: {r}" for n, r in list(probes.coverage(f, selected, local=False).uncovered.items())[:3])
        raise ValueError(
            "method: 'structured' needs a per-layer rule for every selected parameter (Linear, "
            f"convolution, normalisation, embedding layers), which this model lacks ({why or 'a parameter is used outside its module'}). "
            "Use method='auto', or select the covered parameters with wrt=[...]."
        )
    n_params = sum(p.numel() for p in params)
    b2 = x1.shape[0] if x2 is None else x2.shape[0]
    fp = footprint(f, ("ntk", tuple(x1.shape[1:]), x1.dtype, str(x1.device)), f, x1[:1].detach(), 1)
    sizes = _ntk_plan.Sizes(x1.shape[0], b2, n_out, n_params, fp.flops + fp.conv_flops,
                            None if cov is None else _ntk_plan.pair_work(cov, n_out))
    dtype = _engine.result_dtype(params)
    shape = (x1.shape[0], b2) if trace else (x1.shape[0], b2, n_out, n_out)
    result = math.prod(shape) * dtype.itemsize
    budget = _memory.budget(opts.max_memory, x1.device, result)
    if budget is None:
        raise _memory.too_large(result, x1.device, f"ntk: the {'(B1, B2)' if trace else '(B1, B2, Y, Y)'} result",
                                f"{shape} {dtype}", "Pass trace=True for the (B1, B2) kernel, or smaller batches.")
    item = dtype.itemsize
    per_sample = n_out * n_params * item  # a Jacobian block; products also pushes Y tangents over B2 samples
    no_forward = forward_gap(f, [n for n, _ in selected])
    if method == "products" and no_forward is not None:
        raise ValueError(f"method: 'products' pushes rows of J(x1) forward through f(x2) with jvps, but forward "
                         f"mode is not exact for {no_forward}. Use method='auto' or 'contraction'.")
    plan = _ntk_plan.choose(sizes, method, 1, no_forward)
    if plan.method == "products":
        per_sample += int(3 * n_out * b2 * fp.act)
    chunk = _chunk(opts, per_sample, max(x1.shape[0], b2), budget)
    return opts, selected, n_out, cov, budget, dataclasses.replace(plan, sample_chunk=chunk)


@accepts_params_dict
@_guard.entry(_guard.first_input)
def ntk_plan(f: nn.Module, x1: Tensor, x2: Optional[Tensor] = None, *, wrt: Wrt = "params",
             method: str = "auto", trace: bool = False, chunk_size: Optional[int] = None,
             max_memory: Memory = None, kwargs: Optional[dict[str, Any]] = None,
             in_dims: Any = 0) -> _ntk_plan.NtkPlan:
    """Say which method :func:`ntk` would use for these arguments, and why, without running it.

    Returns:
        An ``NtkPlan``: the method, the estimated time of every method that can run, the samples
        per Jacobian block and a one-line reason (its ``repr``; see docs/products.md).

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(784, 20), torch.nn.ReLU(), torch.nn.Linear(20, 10))
        >>> p = jm.ntk_plan(net, torch.randn(256, 784))
        >>> p.method, sorted(p.costs)
        ('structured', ['contraction', 'products', 'structured'])
    """
    with pair_bound(f, x1, x2, kwargs, in_dims) as (g, x1, x2), preserved_state(f), torch.no_grad():
        return _ntk_setup(g, x1, x2, wrt, method, trace, chunk_size, max_memory)[-1]


@accepts_params_dict
@_guard.entry(_guard.first_input)
def ntk(f: nn.Module, x1: Tensor, x2: Optional[Tensor] = None, *, wrt: Wrt = "params", method: str = "auto",
        trace: bool = False, chunk_size: Optional[int] = None, max_memory: Memory = None,
        progress: Optional[bool] = None, kwargs: Optional[dict[str, Any]] = None, in_dims: Any = 0) -> Tensor:
    """The empirical neural tangent kernel K[b1, b2] = J(x1)_b1 J(x2)_b2^T over the parameters.

    Args:
        f: the model, mapping x (B, *in) to (B, *out); Y = prod(out).
        x1: the first batch, (B1, *in). x2: the second batch, (B2, *in); None for x1 itself.
            Either may be a data set (a DataLoader or another iterable of batches, not a tuple or
            list holding tensors): the kernel in blocks, rows by x1's batches (see docs/datasets.md).
        wrt: "params" or a list of parameter names (the kernel of that subset).
        method: "contraction" (Jacobian blocks multiplied chunk by chunk), "products" (rows of
            J(x1) pushed forward through f(x2): no Jacobian of x2), "structured" (per Linear
            layer: (G1 G2^T) * (A1 A2^T), never a P-sized row) or "auto" (the lowest estimated
            time; see :func:`ntk_plan` and docs/products.md).
        trace: sum over the output diagonal: K[b1, b2] = sum_y J(x1)_b1y . J(x2)_b2y.
        chunk_size: samples per Jacobian block (contraction, products).
        max_memory: workspace budget on top of the result, in bytes or as "2GB", as in
            :func:`jacmode.jacobian` (docs/memory.md); the result itself must fit the free memory.
        progress: for data sets, None shows a progress bar on a terminal, True always, False never.
        kwargs: keyword arguments of the model, passed through (broadcast: the same for x1 and x2).
        in_dims: with x1 and x2 tuples of the model's positional arguments, 0 (batched) or None
            (broadcast, the same tensor in both) per argument, as in :func:`per_sample_grads`.
            With ``argnums`` naming broadcast arguments, f is a function ``fn(params, x)`` and x1,
            x2 tuples of its arguments: the kernel with respect to those arguments (torch.func's
            functional style, docs/functional.md).

    Returns:
        (B1, B2, Y, Y), or (B1, B2) with ``trace=True``.

    Raises:
        MemoryError: the result is larger than the free memory, before anything is allocated.

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        >>> x1, x2 = torch.randn(4, 3), torch.randn(6, 3)
        >>> k = jm.ntk(net, x1, x2)
        >>> k.shape                                     # (B1, B2, Y, Y)
        torch.Size([4, 6, 2, 2])
        >>> J1, J2 = jm.jacobian(net, x1, wrt="params"), jm.jacobian(net, x2, wrt="params")
        >>> torch.allclose(k, torch.einsum("byp,czp->bcyz", J1, J2), atol=1e-5)
        True
        >>> jm.ntk(net, x1, x2, trace=True, method="products").shape
        torch.Size([4, 6])
    """
    if several(x1) or several(x2) or kwargs:  # see the note [Several arguments of a model]
        with pair_bound(f, x1, x2, kwargs, in_dims) as (g, i1, i2), preserved_state(f):
            return ntk(g, i1, i2, wrt=wrt, method=method, trace=trace, chunk_size=chunk_size,
                       max_memory=max_memory)
    if _data.is_batches(x1, "x1") or _data.is_batches(x2, "x2"):  # data sets: Gram blocks (docs/datasets.md)
        return _data.ntk_over(ntk, f, x1, x2, method=method, trace=trace, progress=progress, wrt=wrt,
                              chunk_size=chunk_size, max_memory=max_memory)
    with preserved_state(f), torch.no_grad():
        opts, selected, n_out, cov, budget, plan = _ntk_setup(f, x1, x2, wrt, method, trace, chunk_size, max_memory)
        names, params = [n for n, _ in selected], [p for _, p in selected]
        if plan.method == "structured" and cov is not None:
            with contextlib.suppress(NotCovered):
                return _ntk.structured(f, cov, x1, x2, n_out, trace)
        second = x1 if x2 is None else x2
        if plan.method == "products":
            try:
                return _ntk.products(f, _jacobian_of(f, names, max_memory), x1, second, names, params, n_out,
                                     trace, plan.sample_chunk)
            except (NotImplementedError, RuntimeError) as exc:  # an op without a jvp formula
                gap = classify(exc)
                if gap is None or gap[0] != "forward":
                    raise
                if method == "products":
                    raise ValueError(f"method: 'products' pushes rows of J(x1) forward through f(x2) with jvps, "
                                     f"but {gap[1]} has no forward-AD formula. Use method='auto' or "
                                     "'contraction'.") from exc
        keep = second.shape[0] * n_out * sum(p.numel() for p in params) * 4 <= budget // 2
        return _ntk.contraction(_jacobian_of(f, names, max_memory), x1, second, n_out, trace, plan.sample_chunk,
                                keep, _engine.result_dtype(params))


@accepts_params_dict
@_guard.entry(_guard.first_input)
def ggn(f: nn.Module, x: Tensor, loss: Union[str, Callable[[Tensor], Tensor]] = "mse", *,
        y: Optional[Tensor] = None, wrt: Wrt = "params", diagonal: bool = False,
        chunk_size: Optional[int] = None, max_memory: Memory = None, progress: Optional[bool] = None,
        v: Any = None, kwargs: Optional[dict[str, Any]] = None, in_dims: Any = 0) -> Any:
    """The generalised Gauss-Newton matrix sum_b J_b^T H_b J_b, or its diagonal.

    H_b is the Hessian of sample b's loss with respect to its output f(x_b) (Y values).

    Args:
        f: the model, mapping x (B, *in) to (B, *out); Y = prod(out).
        x: the batch, (B, *in), or a data set (a DataLoader or another iterable of batches, not a
            tuple or list holding tensors): summed over its batches (see docs/datasets.md).
        loss: "mse" (per-sample loss 0.5 * ||f(x_b) - y_b||^2, H = I), "cross_entropy" (torch's
            convention: classes on dim 1 of f(x) (B, C, *T), one softmax per position, summed over
            positions; per position H = diag(p) - p p^T with p = softmax over the C classes), one
            of torch's loss modules with its targets ``y`` (any ``reduction``: the GGN of torch's
            batch loss, see docs/products.md), or a callable mapping f(x) to the per-sample
            Hessians (B, Y, Y). The strings' Hessians do not depend on the targets.
        y: targets for a torch loss module, one row per sample (ignored by the strings).
        wrt: "params" or a list of parameter names.
        diagonal: return the diagonal (P,) without ever forming (P, P).
        chunk_size: samples per Jacobian block of the generic engine.
        max_memory: workspace budget on top of the result, in bytes or as "2GB", as in
            :func:`jacmode.jacobian` (docs/memory.md); the result itself must fit the free memory.
        progress: for a data set, None shows a progress bar on a terminal, True always, False never.
        v: a parameter vector (a dict name -> tensor, or a flat (P,) tensor): return the
            Gauss-Newton-vector product G v instead, shaped like v, from one jvp, the loss
            Hessians and one vjp, never forming J or G (see docs/products.md).
        kwargs: keyword arguments of the model, passed through.
        in_dims: with x a tuple of the model's positional arguments, 0 (batched) or None
            (broadcast) per argument, as in :func:`per_sample_grads`. With ``argnums`` naming
            broadcast arguments, f is a function ``fn(params, x)`` and x a tuple of its arguments:
            the matrix with respect to those arguments' leaves, in their order (torch.func's
            functional style, docs/functional.md).

    Returns:
        (P, P), or (P,) with ``diagonal=True``; summed over samples, not averaged. With ``v``,
        G v shaped like ``v``.

    Raises:
        MemoryError: the result is larger than the free memory, before anything is allocated
            (for (P, P), pass diagonal=True).

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        >>> x = torch.randn(10, 3)
        >>> G = jm.ggn(net, x, "cross_entropy")
        >>> G.shape                                     # (P, P), P = 3*8 + 8 + 8*4 + 4
        torch.Size([68, 68])
        >>> torch.allclose(jm.ggn(net, x, "cross_entropy", diagonal=True), G.diagonal(), atol=1e-6)
        True
    """
    if v is not None:  # the Gauss-Newton-vector product (see _vector.py)
        _checks.check_function(f)
        _checks.check_outside_transforms("ggn", PRODUCT_WHY, PRODUCT_INSTEAD)
        _checks.check_ggn_loss(loss, diagonal)
        if diagonal:
            raise ValueError("diagonal: ggn(..., v=...) returns the product G v; pass one of diagonal=True or v=.")
        _checks.check_torch_loss(loss, y, "ggn")
        if not several(x) and _data.is_batches(x):
            raise ValueError("v: ggn(..., v=) takes one batch x; for a data set, sum the products of its batches: "
                             "`sum(jm.ggn(model, xb, loss, y=yb, v=v) for xb, yb in loader)`.")
        return ggn_vector(f, x, loss, y, v, wrt, kwargs, in_dims)
    if several(x) or kwargs:  # see the note [Several arguments of a model]
        with bound(f, x, kwargs, in_dims) as (g, idx), preserved_state(f):
            return ggn(g, idx, loss, y=y, wrt=wrt, diagonal=diagonal, chunk_size=chunk_size,
                       max_memory=max_memory)
    if _data.is_batches(x):  # a data set: summed batch by batch (docs/datasets.md)
        return _data.ggn_over(ggn, f, x, loss, y=y, diagonal=diagonal, progress=progress, wrt=wrt,
                              chunk_size=chunk_size, max_memory=max_memory)
    opts, selected = _setup(f, x, wrt, chunk_size, max_memory, product="ggn")
    _checks.check_ggn_loss(loss, diagonal)
    _checks.check_torch_loss(loss, y, "ggn")
    _checks.check_ggn_target(loss, y, x.shape[0])
    params = [p for _, p in selected]
    n_params = sum(p.numel() for p in params)
    dtype = _engine.result_dtype(params)
    item = dtype.itemsize
    shape = (n_params,) if diagonal else (n_params, n_params)
    result_bytes = math.prod(shape) * item
    budget = _memory.budget(opts.max_memory, x.device, result_bytes)
    if budget is None:
        raise _memory.too_large(
            result_bytes, x.device, f"ggn: the {'(P,) diagonal' if diagonal else '(P, P) matrix'}", f"{shape} {dtype}",
            "Select fewer parameters with wrt=[...]." if diagonal
            else "Pass diagonal=True for the diagonal (P,), or select fewer parameters with wrt=[...].")
    with preserved_state(f), torch.no_grad():
        n_out = math.prod(_out_shape(f, x))
        factor = _engine.factor_for(loss, n_out, y)
        cov = layerio.usable(f, x, selected) if diagonal else None
        rest = selected if cov is None else [(n, p) for n, p in selected if n not in cov.covered]
        result: Optional[Tensor] = None
        if cov is not None:
            try:
                result = _engine.ggn_diagonal_layers(f, cov, x, factor, selected)
            except NotCovered:
                rest = selected
        if not rest and result is not None:
            return result
        n_rest = sum(p.numel() for _, p in rest)
        chunk = _chunk(opts, n_out * n_rest * item, x.shape[0], budget)
        names = [n for n, _ in rest]
        part = _engine.ggn_generic(f, _jacobian_of(f, names, max_memory), x, factor(f(x)), names, n_rest, diagonal,
                                   chunk)
        if result is None or len(rest) == len(selected):
            return part
        cols = columns(selected)
        for (name, _), (lo, n) in zip(rest, columns(rest).values()):
            result[cols[name][0]:cols[name][0] + n] = part[lo:lo + n]
        return result

