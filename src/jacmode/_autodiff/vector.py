"""Products with the Jacobian or Hessian that never form them: jvp, vjp, hvp, G v, linearize.

NOTE: [Vector products]
All engines work on lists of tensors (the flattened leaves of the differentiated pytree) and a
function of those lists; the fronts (``_vector.py``) validate and restore the layout.

* jvp: forward mode with dual tensors (``torch.autograd.forward_ad``), one pass over the whole
  batch: for independent samples output row b is J_b v_b, for parameters J_b v for every sample b.
  Where an op has no forward formula, the transpose of a vjp: g(u) = J^T u is linear in u, so the
  vjp of g in direction v is J v (two reverse passes, no Jacobian).
* vjp: reverse mode, one recorded forward; ``vjp_fn`` replays the backward with ``retain_graph``.
  Per-sample products over parameters, u_b^T J_b (B, P), are per-sample gradients of the linear
  loss u . f(x): the probe engine's rows (``_probes/layerio.py``: one reverse pass of u gives
  each covered layer's cotangents, sample b's weight row is G_b (x) a_b), the others by
  ``vmap(grad)``, as ``per_sample_grads`` does.
* hvp: reverse over reverse (the gradient of g . v, g the gradient recorded with its graph; the
  faster route on every size measured) or forward over reverse (dual tensors through a recorded
  reverse pass: the tangent of the gradient is H v); for a sum of independent per-sample scalars
  the gradient's row b depends on x_b alone, so one pass gives every H_b v_b.
* G v = J^T H J v: a jvp (J v, B rows), the output Hessian of each sample's loss applied to its
  row, and one vjp; never J.
* linearize: one recorded forward and the reverse pass g(u0) = J^T u0 built once with its graph;
  J v is then one backward pass through g (the transpose trick above), J^T u one backward pass
  through the forward: no re-validation, no re-probing per application.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.func import functional_call

from .._threads import clone_tree, dual_level  # one thread at a time: see [Threads] in _threads.py
from .._rules.base import NotCovered
from .._probes import layerio, layerwise, probes
from .._probes import products as _products

Fn = Callable[[list[Tensor]], tuple[list[Tensor], Any]]  # leaves -> (output leaves, extra)


def _zeros_for(grads: Sequence[Optional[Tensor]], like: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, like)]


def forward_gap(exc: BaseException) -> bool:
    """Whether ``exc`` says an op has no forward-mode formula (the reverse route can run)."""
    msg = str(exc)
    return isinstance(exc, (NotImplementedError, RuntimeError)) and (
        "forward AD" in msg or "jvp function for custom autograd.Function" in msg or "forward-mode" in msg)


def jvp_forward(fn: Fn, primals: Sequence[Tensor], tangents: Sequence[Tensor],
                create_graph: bool) -> tuple[list[Tensor], list[Tensor], Any]:
    """(outputs, J v, extra) by dual tensors; ``fn`` returns (output leaves, extra)."""
    ctx = torch.enable_grad() if create_graph else torch.no_grad()
    with ctx, dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents)]
        outs, extra = fn(list(duals))
        pairs = [fwAD.unpack_dual(o) for o in outs]
        extra = _unpack_tree(extra)
    values = [p.primal for p in pairs]
    return values, [torch.zeros_like(v) if p.tangent is None else p.tangent for v, p in zip(values, pairs)], extra


def _unpack_tree(tree: Any) -> Any:
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: fwAD.unpack_dual(t).primal if isinstance(t, Tensor) else t, tree)


def jvp_reverse(fn: Fn, primals: Sequence[Tensor], tangents: Sequence[Tensor],
                create_graph: bool) -> tuple[list[Tensor], list[Tensor], Any]:
    """(outputs, J v, extra) as the vjp of the linear map u -> J^T u (no forward mode needed)."""
    rec = Recorded(fn, primals, create_graph)
    return rec.values(), rec.jvp(tangents), rec.extra


def jvp_any(fn: Fn, primals: Sequence[Tensor], tangents: Sequence[Tensor],
            create_graph: bool) -> tuple[list[Tensor], list[Tensor], Any]:
    """Forward mode, or the reverse route where an op has no forward formula."""
    try:
        return jvp_forward(fn, primals, tangents, create_graph)
    except (NotImplementedError, RuntimeError) as exc:
        if not forward_gap(exc):
            raise
    return jvp_reverse(fn, primals, tangents, create_graph)


class Recorded:
    """One recorded forward pass of ``fn`` at ``primals``: its vjp, and its jvp by the transpose trick."""

    def __init__(self, fn: Fn, primals: Sequence[Tensor], create_graph: bool) -> None:
        self.create_graph = create_graph
        with torch.enable_grad():
            self.leaves = [p if (create_graph and p.requires_grad) else p.detach().requires_grad_(True)
                           for p in primals]
            self.outs, self.extra = fn(self.leaves)
        self.diff = [i for i, o in enumerate(self.outs) if isinstance(o, Tensor) and o.requires_grad]
        self._g: Optional[list[Optional[Tensor]]] = None
        self._us: list[Tensor] = []

    def values(self) -> list[Tensor]:
        return list(self.outs) if self.create_graph else [o.detach() for o in self.outs]

    def vjp(self, cotangents: Sequence[Tensor]) -> list[Tensor]:
        """J^T u, one reverse pass of the recorded graph (kept for the next call)."""
        outs = [self.outs[i] for i in self.diff]
        us = [cotangents[i] for i in self.diff]
        if not outs:
            return [torch.zeros_like(t) for t in self.leaves]
        g = torch.autograd.grad(outs, self.leaves, us, retain_graph=True, create_graph=self.create_graph,
                                allow_unused=True)
        return _zeros_for(g, self.leaves)

    def jvp(self, tangents: Sequence[Tensor]) -> list[Tensor]:
        """J v, one reverse pass through g(u0) = J^T u0 (built once, on the first call)."""
        if self._g is None:
            with torch.enable_grad():
                self._us = [torch.zeros_like(self.outs[i], requires_grad=True) for i in self.diff]
                outs = [self.outs[i] for i in self.diff]
                self._g = (list(torch.autograd.grad(outs, self.leaves, self._us, retain_graph=True, create_graph=True,
                                                    allow_unused=True)) if outs else [None] * len(self.leaves))
        pairs = [(gi, t) for gi, t in zip(self._g, tangents) if gi is not None and gi.requires_grad]
        res: Sequence[Optional[Tensor]] = [None] * len(self._us)
        if pairs:
            res = torch.autograd.grad([a for a, _ in pairs], self._us, [t for _, t in pairs], retain_graph=True,
                                      create_graph=self.create_graph, allow_unused=True)
        it = iter(_zeros_for(res, self._us))
        return [next(it) if i in self.diff else torch.zeros_like(o) for i, o in enumerate(self.outs)]


def hvp(scalar: Callable[[list[Tensor]], Tensor], primals: Sequence[Tensor], tangents: Sequence[Tensor],
        route: str, create_graph: bool) -> list[Tensor]:
    """H v of ``scalar`` at ``primals``: route "forward" (forward over reverse) or "reverse"."""
    if route == "forward" and not create_graph:
        try:
            with torch.enable_grad(), dual_level():
                leaves = [p.detach().requires_grad_(True) for p in primals]
                duals = [fwAD.make_dual(a, t) for a, t in zip(leaves, tangents)]
                g = torch.autograd.grad(scalar(duals), leaves, allow_unused=True)
                out = []
                for gi, p in zip(g, primals):
                    tan = None if gi is None else fwAD.unpack_dual(gi).tangent
                    out.append(torch.zeros_like(p) if tan is None else tan.detach())
                return out
        except (NotImplementedError, RuntimeError) as exc:
            # torch's forward formula of some backward kernels writes into a ZeroTensor (mse_loss_backward,
            # torch 2.x: torch.func.jvp(grad(...)) raises the same); reverse over reverse is exact there
            if not forward_gap(exc) and "ZeroTensors are immutable" not in str(exc):
                raise
    with torch.enable_grad():
        leaves = [p if (create_graph and p.requires_grad) else p.detach().requires_grad_(True) for p in primals]
        g = torch.autograd.grad(scalar(leaves), leaves, create_graph=True, allow_unused=True)
        pairs = [(gi, t) for gi, t in zip(g, tangents) if gi is not None and gi.requires_grad]
        if not pairs:
            return [torch.zeros_like(p) for p in primals]
        hv = torch.autograd.grad([a for a, _ in pairs], leaves, [t for _, t in pairs], create_graph=create_graph,
                                 allow_unused=True)
    return _zeros_for(hv, primals)


class PerSampleVjp:
    """u -> (B, P) rows u_b^T J_b over the selected parameters of ``model`` at ``x`` (see the note).

    Records the probed forward pass once; each call is one reverse pass of u and the per-layer
    writes (covered parameters), plus ``vmap(grad)`` of u . f(x) for the others, within
    ``bound()``: the context a call that outlives the caller's block runs ``model`` in (a module of
    sample rows reads its call's arguments there, see ``_args/params.py``).
    """

    def __init__(self, model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], chunk: int,
                 random_layers: bool, probes_ok: bool = True,
                 bound: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        self.model, self.x, self.named, self.chunk, self.bound = model, x, list(named), chunk, bound
        self.cols = layerwise.columns(self.named)
        self.n_params = sum(p.numel() for _, p in self.named)
        self.dtype = _products.result_dtype([p for _, p in self.named])
        cov = layerio.usable(model, x, self.named) if probes_ok else None  # probes read the module's own tensors
        if cov is not None and cov.uncovered and random_layers:
            cov = None  # two passes would draw two dropout masks
        self.cov = cov
        self.rec: Optional[probes.Recording] = None
        if cov is not None:
            with torch.enable_grad():
                self.rec = probes.record(model, x, cov)
            if any(c.stale for c in self.rec.calls):
                self.rec, self.cov = None, None
        self.rest = self.named if self.cov is None else [(n, p) for n, p in self.named if n not in self.cov.covered]
        if self.rec is not None:
            self.output = self.rec.output.detach()
        else:  # at the parameters given (functional ones are not the module's own)
            with torch.no_grad():
                self.output = functional_call(clone_tree(model), {n: p.detach() for n, p in self.named}, (x,))

    def __call__(self, u: Tensor) -> Tensor:
        batch = u.shape[0]
        result = torch.empty(batch, self.n_params, dtype=self.dtype, device=u.device)
        if self.rec is not None and self.cov is not None:
            with torch.enable_grad():
                gs = self.rec.pullback(u.unsqueeze(0), retain_graph=True)
            try:
                layerwise.write(self.rec, gs, self.cov, self.named, result.unsqueeze(1))
            except NotCovered:
                self.rec, self.cov, self.rest = None, None, self.named
        if self.rest:
            def linear(out: Tensor, ub: Tensor) -> Tensor:
                return (out * ub).reshape(out.shape[0], -1).sum(1)

            with self.bound():
                _products.per_sample_grads_generic(self.model, self.x, u, linear, self.rest, self.cols, result,
                                                   self.chunk)
        return result
