"""The empirical neural tangent kernel, three ways: contraction, products, structured.

NOTE: [Three ways to the NTK]
K[b1, b2, y1, y2] = J(x1)[b1, y1, :] . J(x2)[b2, y2, :], a sum over the P parameters.

* contraction: the Jacobians (B, Y, P) of both batches, chunk by chunk of samples, multiplied as
  matrices (B1*Y, P) @ (P, B2*Y). Costs two Jacobians and B1*B2*Y^2*P multiply-adds.
* products: NTK-vector products. Each row J(x1)[b1, y1] is pushed forward through f(x2) with one
  jvp over the whole second batch, giving a column block K[b1, :, y1, :] without forming J(x2).
  Costs one Jacobian and B1*Y jvps over B2 samples; wins when a forward pass costs little next to
  Y*P (wide outputs) and loses with weight sharing (convolutions: forward flops >> P).
* structured: per layer (covered Linear layers, see ``_engines/layerio.py``). With the layer's
  inputs A (B, I) and output cotangents G (Y, B, O) of both batches, the weight block is
  (G1 G2^T) * (A1 A2^T) elementwise and the bias block G1 G2^T: never a P-sized row, about
  B1*B2*(Y^2*O + I) multiply-adds per layer after one reverse pass of Y cotangents per batch.

The three agree to rounding; ``_planning/ntk.py`` picks one from the sizes.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vmap

from . import layerio


def _jacobians(model: nn.Module, x: Tensor, names: Sequence[str], chunk: int,
               max_memory: Any) -> Iterator[tuple[int, Tensor]]:
    from .._jacobian import jacobian

    for b0 in range(0, x.shape[0], chunk):
        jac = jacobian(model, x[b0:b0 + chunk], wrt=list(names), max_memory=max_memory)
        assert isinstance(jac, Tensor)
        yield b0, jac


def _empty(x1: Tensor, b2: int, y: int, trace: bool) -> Tensor:
    return x1.new_zeros(x1.shape[0], b2) if trace else x1.new_zeros(x1.shape[0], b2, y, y)


def contraction(model: nn.Module, x1: Tensor, x2: Tensor, names: Sequence[str], n_out: int,
                trace: bool, chunk: int, keep_second: bool, max_memory: Any) -> Tensor:
    """K from Jacobian blocks; the second batch's blocks are kept if ``keep_second``, else redone."""
    result = _empty(x1, x2.shape[0], n_out, trace)
    second = list(_jacobians(model, x2, names, chunk, max_memory)) if keep_second else None
    for b0, j1 in _jacobians(model, x1, names, chunk, max_memory):
        for c0, j2 in second if second is not None else _jacobians(model, x2, names, chunk, max_memory):
            b1, c1 = b0 + j1.shape[0], c0 + j2.shape[0]
            if trace:
                result[b0:b1, c0:c1] = torch.einsum("byp,cyp->bc", j1, j2)
            else:
                block = j1.reshape(-1, j1.shape[-1]) @ j2.reshape(-1, j2.shape[-1]).t()
                result[b0:b1, c0:c1] = block.view(j1.shape[0], n_out, j2.shape[0], n_out).permute(0, 2, 1, 3)
    return result


def products(model: nn.Module, x1: Tensor, x2: Tensor, names: Sequence[str], params: Sequence[Tensor],
             n_out: int, trace: bool, chunk: int, max_memory: Any) -> Tensor:
    """K from rows of J(x1) pushed forward through f(x2), ``chunk`` samples of x1 at a time."""
    sizes = [p.numel() for p in params]
    z = torch.cat([p.detach().reshape(-1) for p in params])

    def f2(flat: Tensor) -> Tensor:
        named = {n: t.view(p.shape) for n, t, p in zip(names, flat.split(sizes), params)}
        return functional_call(model, named, (x2,)).reshape(x2.shape[0], n_out)

    push = vmap(lambda row: jvp(f2, (z,), (row,))[1], randomness="different")
    result = _empty(x1, x2.shape[0], n_out, trace)
    for b0, j1 in _jacobians(model, x1, names, chunk, max_memory):
        cols = push(j1.reshape(-1, z.numel())).view(j1.shape[0], n_out, x2.shape[0], n_out)
        b1 = b0 + j1.shape[0]
        if trace:
            result[b0:b1] = torch.diagonal(cols, dim1=1, dim2=3).sum(-1)
        else:
            result[b0:b1] = cols.permute(0, 2, 1, 3)
    return result


def _layer_io(model: nn.Module, modules: Sequence[nn.Linear], x: Tensor,
              n_out: int) -> list[tuple[layerio.Layer, Tensor]]:
    with torch.enable_grad(), layerio.recorded(modules) as calls:
        out = model(x)
        eye = torch.eye(n_out, dtype=out.dtype, device=out.device)
        v = eye.unsqueeze(1).expand(n_out, x.shape[0], n_out).reshape(n_out, *out.shape)
        gs = layerio.cotangents(out, calls, v)
    return list(zip(calls, gs))


def structured(model: nn.Module, modules: Sequence[nn.Linear], x1: Tensor, x2: Optional[Tensor],
               params: Sequence[Tensor], n_out: int, trace: bool) -> Tensor:
    """K per covered Linear layer from its inputs and output cotangents (see the note)."""
    first = _layer_io(model, modules, x1, n_out)
    second = first if x2 is None else _layer_io(model, modules, x2, n_out)
    b2 = x1.shape[0] if x2 is None else x2.shape[0]
    result = _empty(x1, b2, n_out, trace)
    wanted = {id(p) for p in params}
    for (c1, g1), (c2, g2) in zip(first, second):
        m = c1.module
        w, b = id(m.weight) in wanted, m.bias is not None and id(m.bias) in wanted
        if c1.inputs.dim() == 2:
            scale = (c1.inputs @ c2.inputs.t() if w else 0) + (1 if b else 0)
            gram = torch.einsum("ybo,yco->bc" if trace else "ybo,zco->bcyz", g1, g2)
            result += gram * (scale if trace or not w else scale[:, :, None, None])
            continue
        for on, rows1, rows2 in ((w, layerio.weight_grads(c1, g1), layerio.weight_grads(c2, g2)),
                                 (b, layerio.bias_grads(g1), layerio.bias_grads(g2))):
            if on:
                r1, r2 = rows1.flatten(2), rows2.flatten(2)
                result += torch.einsum("ybp,ycp->bc" if trace else "ybp,zcp->bcyz", r1, r2)
    return result
