"""Per-sample gradients and the Gauss-Newton matrix, per layer where possible, generic otherwise.

NOTE: [Products without the Jacobian]
Per-sample gradients are J_b^T g_b with g_b = d loss_b / d f(x_b): for covered layers (see
``_engines/layerio.py``) one forward pass and one reverse pass of sum_b loss_b give each layer's
cotangent G (B, O) (samples are independent, so row b only depends on loss_b), and the weight
gradient of sample b is G_b (x) a_b, written straight into its slice of the (B, P) result
(Opacus's method). Otherwise ``vmap(grad)`` of the per-sample loss over ``functional_call``.

The GGN is sum_b J_b^T H_b J_b with H_b = L_b S_b L_b^T (a factor with K columns and signs S = +-1:
the identity for MSE, diag(sqrt p) - p sqrt(p)^T for softmax cross-entropy, an eigendecomposition
for a callable). Its diagonal is sum_{b,k} s_bk (J_b^T l_bk)^2; for a Linear layer that is
(sum_k s G_k^2)^T (a^2) per weight, O(B*K*(I+O)) work and O(P) memory beyond one reverse pass of K
cotangents. The generic route forms J (B_chunk, Y, P) with :func:`jacmode.jacobian`, chunk by chunk,
multiplies by L and accumulates squares (diagonal) or (JL)^T S (JL) (full matrix).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from . import layerio

Factor = tuple[Tensor, Optional[Tensor]]  # L (B, Y, K), signs (B, K) or None (all +1)


def covered(model: nn.Module, x: Tensor, params: Sequence[Tensor]) -> Optional[list[nn.Linear]]:
    """The Linear layers that give every selected parameter per layer, or None (generic engine)."""
    if not x.is_floating_point():
        return None
    modules = layerio.owners(model, params)
    if modules is None:
        return None
    flags = tuple(m.training for m in model.modules())
    key = (tuple(x.shape[1:]), x.dtype, str(x.device), tuple(id(p) for p in params), flags)
    return modules if layerio.complete(model, key, x[:2], modules, params) else None


def _offsets(params: Sequence[Tensor]) -> dict[int, tuple[int, int]]:
    offsets, start = {}, 0
    for p in params:
        offsets[id(p)] = (start, p.numel())
        start += p.numel()
    return offsets


def per_sample_grads_layers(model: nn.Module, modules: Sequence[nn.Linear], x: Tensor,
                            losses: Callable[[Tensor], Tensor], params: Sequence[Tensor]) -> Tensor:
    """(B, P) per-sample gradients from one forward and one reverse pass (covered layers)."""
    with torch.enable_grad(), layerio.recorded(modules) as calls:
        out = model(x)
        loss = losses(out)
        g_out = torch.autograd.grad(loss.sum(), out, retain_graph=True)[0]
        gs = layerio.cotangents(out, calls, g_out.unsqueeze(0))
    offsets = _offsets(params)
    batch = x.shape[0]
    result = x.new_empty(batch, sum(p.numel() for p in params))
    for c, g in zip(calls, gs):
        m = c.module
        if id(m.weight) in offsets:
            lo, n = offsets[id(m.weight)]
            target = result[:, lo:lo + n].view(batch, *m.weight.shape)
            if c.inputs.dim() == 2:
                torch.mul(g[0].unsqueeze(-1), c.inputs.unsqueeze(1), out=target)
            else:
                target.copy_(layerio.weight_grads(c, g)[0])
        if m.bias is not None and id(m.bias) in offsets:
            lo, n = offsets[id(m.bias)]
            result[:, lo:lo + n].copy_(layerio.bias_grads(g)[0])
    return result


def per_sample_grads_generic(model: nn.Module, x: Tensor, y: Optional[Tensor], loss: Callable[..., Tensor],
                             names: Sequence[str], params: Sequence[Tensor], chunk: int) -> Tensor:
    """(B, P) per-sample gradients by ``vmap(grad)`` of the per-sample loss, ``chunk`` samples a pass."""
    def one(p: dict[str, Tensor], xb: Tensor, yb: Optional[Tensor]) -> Tensor:
        out = functional_call(model, p, (xb.unsqueeze(0),))
        value = loss(out) if yb is None else loss(out, yb.unsqueeze(0))
        return value.reshape(())

    primal = {n: p.detach() for n, p in zip(names, params)}
    step = vmap(grad(one), in_dims=(None, 0, None if y is None else 0), randomness="different")
    rows = []
    for b0 in range(0, x.shape[0], chunk):
        yb = None if y is None else y[b0:b0 + chunk]
        g = step(primal, x[b0:b0 + chunk], yb)
        rows.append(torch.cat([g[n].reshape(g[n].shape[0], -1) for n in names], dim=1))
    return torch.cat(rows) if rows else x.new_zeros(0, sum(p.numel() for p in params))


def ggn_diagonal_layers(model: nn.Module, modules: Sequence[nn.Linear], x: Tensor,
                        factor: Callable[[Tensor], Factor], params: Sequence[Tensor]) -> Tensor:
    """(P,) GGN diagonal from one forward pass and one reverse pass of K cotangents."""
    with torch.enable_grad(), layerio.recorded(modules) as calls:
        out = model(x)
        lf, signs = factor(out.detach())
        v = lf.permute(2, 0, 1).reshape(lf.shape[2], *out.shape)  # (K, B, *out)
        gs = layerio.cotangents(out, calls, v)
    offsets = _offsets(params)
    result = x.new_zeros(sum(p.numel() for p in params))
    for c, g in zip(calls, gs):
        m = c.module
        g2 = g * g
        if signs is not None:
            g2 = g2 * signs.t().reshape(*signs.t().shape, *([1] * (g.dim() - 2)))
        if id(m.weight) in offsets:
            lo, n = offsets[id(m.weight)]
            if c.inputs.dim() == 2:
                block = g2.sum(0).t() @ (c.inputs * c.inputs)
            else:
                w = layerio.weight_grads(c, g)
                block = (w * w * (1 if signs is None else signs.t()[:, :, None, None])).sum((0, 1))
            result[lo:lo + n] += block.reshape(-1)
        if m.bias is not None and id(m.bias) in offsets:
            lo, n = offsets[id(m.bias)]
            bg = layerio.bias_grads(g)
            b2 = bg * bg * (1 if signs is None else signs.t()[:, :, None])
            result[lo:lo + n] += b2.sum((0, 1))
    return result


def ggn_generic(model: nn.Module, x: Tensor, factor: Callable[[Tensor], Factor], names: Sequence[str],
                n_params: int, diagonal: bool, chunk: int, max_memory: Any) -> Tensor:
    """(P,) diagonal or (P, P) GGN from Jacobian chunks of ``chunk`` samples (any model)."""
    from .._jacobian import jacobian

    result = x.new_zeros(n_params) if diagonal else x.new_zeros(n_params, n_params)
    for b0 in range(0, x.shape[0], chunk):
        xb = x[b0:b0 + chunk]
        jac = jacobian(model, xb, wrt=list(names), max_memory=max_memory)
        assert isinstance(jac, Tensor)
        with torch.no_grad():
            lf, signs = factor(model(xb))
        jl = torch.einsum("byp,byk->bkp", jac, lf)  # (b, K, P): rows J_b^T l_bk
        weighted = jl if signs is None else jl * signs[:, :, None]
        if diagonal:
            result += (weighted * jl).sum((0, 1))
        else:
            result += weighted.reshape(-1, n_params).t() @ jl.reshape(-1, n_params)
    return result
