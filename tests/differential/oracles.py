"""Float64 oracles for every entry point, independent of jacmode.

Every oracle runs on the primitive spelling of the model (``grammar.build(case, primitive=True)``:
norms and softmax written in mean / subtract / rsqrt / exp), so torch's own higher-order formulas
of fused ops never enter. Input derivatives come from torch.func (``jacrev`` for first order,
nested ``jacfwd`` above), one sample at a time with the other samples held fixed, which is also
the definition of ``structure="coupled"``; parameter Jacobians and the products come from loops
of ``torch.autograd.grad`` over samples evaluated alone (the users' loop of problems.md). All of
it is differentiable, so the same oracles serve the create_graph conventions.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacfwd, jacrev

Fn = Callable[[Tensor], Tensor]


def _sample_fn(f: Fn, x: Tensor, b: int) -> Fn:
    """x_b -> f(x with row b replaced by x_b)[b]: sample b with the others held fixed."""

    def g(xb: Tensor) -> Tensor:
        return f(torch.cat([x[:b], xb.unsqueeze(0), x[b + 1 :]]))[b]

    return g


def _nested(g: Fn, order: int, kind: Callable = jacfwd) -> Fn:
    for _ in range(order):
        g = kind(g)
    return g


def derivatives(f: Fn, x: Tensor, order: int) -> Tensor:
    """(B, *out, D, ..., D): every order-th partial of each sample, coordinates counted flat."""
    in_shape = x.shape[1:]
    blocks = []
    for b in range(x.shape[0]):
        g = _sample_fn(f, x, b)
        flat = lambda v, g=g: g(v.reshape(in_shape))  # noqa: E731
        blocks.append(_nested(flat, order, jacrev if order == 1 else jacfwd)(x[b].reshape(-1)))
    return torch.stack(blocks)


def input_jacobian(f: Fn, x: Tensor, batched: bool) -> Tensor:
    if not batched:
        return jacrev(f)(x)
    d = derivatives(f, x, 1)
    return d.reshape(*d.shape[:-1], *x.shape[1:])


def diagonal(f: Fn, x: Tensor, batched: bool) -> Tensor:
    """The diagonal of the (per-sample, or with batched=False the full) Jacobian, shape of x."""
    j = input_jacobian(f, x, batched)
    n = x[0].numel() if batched else x.numel()
    return j.reshape(-1, n, n).diagonal(dim1=-2, dim2=-1).reshape(x.shape)


def derivative(f: Fn, t: Tensor, order: int, as_given: bool = False) -> Tensor:
    """d^k f / dt^k per sample, f applied to t (B, 1), or to t as given when f takes (B,)."""
    t = t if as_given else t.reshape(-1, 1)
    return derivatives(f, t, order).reshape(t.shape[0], *f(t).shape[1:])


def partial(f: Fn, x: Tensor, dims: Sequence[int]) -> Tensor:
    d = derivatives(f, x, len(dims))
    return d[(Ellipsis, *dims)]


def hessian(f: Fn, x: Tensor) -> Tensor:
    d = derivatives(f, x, 2)
    return d.reshape(*d.shape[:-2], *x.shape[1:], *x.shape[1:])


def laplacian(f: Fn, x: Tensor) -> Tensor:
    return derivatives(f, x, 2).diagonal(dim1=-2, dim2=-1).sum(-1)


def weighted_laplacian(f: Fn, x: Tensor, S: Tensor) -> Tensor:
    """tr(S S^T Hess f) per sample and output."""
    H = derivatives(f, x, 2)
    return torch.einsum("...ij,ik,jk->...", H, S, S)


def biharmonic(f: Fn, x: Tensor) -> Tensor:
    """sum_ij d^4 f / dx_i^2 dx_j^2 per sample and output."""
    return torch.einsum("...iijj->...", derivatives(f, x, 4))


def operator(f: Fn, x: Tensor, terms: Sequence[tuple[float, Sequence[int]]]) -> Tensor:
    """sum_k c_k d^(dims_k) f per sample and output (dims () is f itself)."""
    total = torch.zeros_like(f(x))
    for c, dims in terms:
        total = total + c * (partial(f, x, dims) if dims else f(x))
    return total


def divergence(f: Fn, x: Tensor) -> Tensor:
    d = derivatives(f, x, 1)  # (B, *in, D) since out == in
    return d.reshape(x.shape[0], -1, d.shape[-1]).diagonal(dim1=-2, dim2=-1).sum(-1)


# ---------------------------------------------------------------------------------------------
# Parameters: loops of autograd.grad.


def _rows(outputs: Tensor, params: list[Tensor]) -> Tensor:
    rows = []
    for o in outputs.reshape(-1):
        gs = torch.autograd.grad(o, params, retain_graph=True, allow_unused=True, create_graph=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    return torch.stack(rows)


def param_jacobian(net: nn.Module, x: Tensor, batched: bool) -> Tensor:
    """(B, Y, P) over samples evaluated alone, or (B * Y, P) of the whole batch.

    Inside a torch.func transform (jacrev / jacfwd around the call) the rows come from torch.func.jacrev
    over functional_call: autograd.grad loops there do not carry the derivative with respect to the
    transformed x (they gave 0 where float64 finite differences give 1.09)."""
    rows = _func_rows if torch._C._functorch.peek_interpreter_stack() is not None else _module_rows
    if not batched:
        return rows(net, x, False)
    return torch.stack([rows(net, x[b : b + 1], True) for b in range(x.shape[0])])


def _module_rows(net: nn.Module, x: Tensor, sample: bool) -> Tensor:
    out = net(x)
    return _rows(out[0] if sample else out, [p for p in net.parameters() if p.requires_grad])


def _func_rows(net: nn.Module, x: Tensor, sample: bool) -> Tensor:
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    jac = jacrev(lambda p: functional_call(net, p, (x,)).reshape(-1))(params)
    return torch.cat([jac[n].reshape(jac[n].shape[0], -1) for n in params], dim=1)


def per_sample_grads(net: nn.Module, x: Tensor, loss: Callable[..., Tensor], y: Optional[Tensor]) -> Tensor:
    params = [p for p in net.parameters() if p.requires_grad]
    rows = []
    for b in range(x.shape[0]):
        out = net(x[b : b + 1])
        value = loss(out) if y is None else loss(out, y[b : b + 1])
        rows.append(_rows(value[0], params)[0])
    return torch.stack(rows)


def ntk(net: nn.Module, x1: Tensor, x2: Optional[Tensor], trace: bool) -> Tensor:
    j1 = param_jacobian(net, x1, True)
    j2 = j1 if x2 is None else param_jacobian(net, x2, True)
    return torch.einsum("byp,cyp->bc", j1, j2) if trace else torch.einsum("byp,czp->bcyz", j1, j2)


def cross_entropy_hessian(out: Tensor) -> Tensor:
    """(Y, Y) Hessian of torch's cross-entropy at one sample's output (C, *positions) (classes on
    dim 1 of the batch, each position its own softmax), in the flat order of the output."""
    c = out.shape[0]
    logits = out.reshape(c, -1)  # (C, T)
    p = torch.softmax(logits, dim=0)
    n = logits.shape[1]
    h = torch.zeros(c, n, c, n, dtype=out.dtype)
    for t in range(n):
        pt = p[:, t]
        h[:, t, :, t] = torch.diag(pt) - torch.outer(pt, pt)
    return h.reshape(c * n, c * n)


def ggn(net: nn.Module, x: Tensor, loss: str, diagonal: bool) -> Tensor:
    j = param_jacobian(net, x, True).detach()  # (B, Y, P)
    if loss == "mse":
        g = torch.einsum("byp,byq->pq", j, j)
    else:
        with torch.no_grad():
            out = net(x)
        hs = torch.stack([cross_entropy_hessian(out[b]) for b in range(x.shape[0])])
        g = torch.einsum("byp,byz,bzq->pq", j, hs, j)
    return g.diagonal() if diagonal else g


def losses(kind: str) -> Callable[..., Tensor]:
    """The per-sample losses (B,) that per_sample_grads is given."""
    if kind == "sq":
        return lambda out: (out**2).flatten(1).sum(1)
    if kind == "mse_y":
        return lambda out, y: ((out - y) ** 2).flatten(1).mean(1)
    return lambda out, y: F.cross_entropy(out, y, reduction="none").reshape(out.shape[0], -1).sum(1)


def loss_targets(kind: str, out_shape: tuple[int, ...], batch: int, gen: torch.Generator) -> Optional[Tensor]:
    if kind == "sq":
        return None
    if kind == "mse_y":
        return torch.randn(batch, *out_shape, generator=gen, dtype=torch.float64)
    return torch.randint(0, out_shape[0], (batch, *out_shape[1:]), generator=gen)


def flat_dict(value: Any, lead: tuple[int, ...], shapes: dict[str, torch.Size]) -> Tensor:
    """A flatten=False result (name -> (*lead, *param.shape)) as (*lead, P); shapes checked."""
    if not isinstance(value, dict) or list(value) != list(shapes):
        raise AssertionError(f"flatten=False: expected a dict with keys {list(shapes)}, got {type(value).__name__}"
                             f" {list(value) if isinstance(value, dict) else ''}")
    parts = []
    for name, shape in shapes.items():
        v = value[name]
        if tuple(v.shape) != (*lead, *shape):
            raise AssertionError(f"flatten=False: {name} has shape {tuple(v.shape)}, expected {(*lead, *shape)}")
        parts.append(v.reshape(*lead, math.prod(shape)))
    return torch.cat(parts, -1)
