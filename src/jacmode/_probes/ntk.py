"""The empirical neural tangent kernel, three ways: contraction, products, structured.

NOTE: [Three ways to the NTK]
K[b1, b2, y1, y2] = J(x1)[b1, y1, :] . J(x2)[b2, y2, :], a sum over the P parameters.

* contraction: the Jacobians (B, Y, P) of both batches, chunk by chunk of samples, multiplied as
  matrices (B1*Y, P) @ (P, B2*Y). Costs two Jacobians and B1*B2*Y^2*P multiply-adds.
* products: NTK-vector products. Each row J(x1)[b1, y1] is pushed forward through f(x2) with one
  jvp over the whole second batch, giving a column block K[b1, :, y1, :] without forming J(x2).
  Costs one Jacobian and B1*Y jvps over B2 samples; wins when a forward pass costs little next to
  Y*P (wide outputs) and loses with weight sharing (convolutions: forward flops >> P).
* structured: per layer (probed layers, see ``_probes/layerio.py``). For a Linear layer with
  inputs A (B, I) and output cotangents G (Y, B, O) of both batches, the weight block is
  (G1 G2^T) * (A1 A2^T) elementwise and the bias block G1 G2^T: never a P-sized row, about
  B1*B2*(Y^2*O + I) multiply-adds per layer after one reverse pass of Y cotangents per batch.

The three agree to rounding; ``_planning/ntk.py`` picks one from the sizes.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from .._threads import clone_tree, jvp  # jvp one thread at a time: see [Threads] in _threads.py
from . import layerio, probes


# the per-sample parameter Jacobian (b, Y, P) of the selected parameters at a chunk of x (b, *in):
# the caller's (``jm.jacobian`` with its wrt and max_memory)
Jacobian = Callable[[Tensor], Tensor]


def _jacobians(jacobian: Jacobian, x: Tensor, chunk: int) -> Iterator[tuple[int, Tensor]]:
    for b0 in range(0, x.shape[0], chunk):
        yield b0, jacobian(x[b0:b0 + chunk])


def _empty(x1: Tensor, b2: int, y: int, trace: bool, dtype: torch.dtype) -> Tensor:
    """The zeroed result in the parameters' dtype (never x1's: token ids are integers)."""
    return torch.zeros((x1.shape[0], b2) if trace else (x1.shape[0], b2, y, y), dtype=dtype, device=x1.device)


def contraction(jacobian: Jacobian, x1: Tensor, x2: Tensor, n_out: int, trace: bool, chunk: int,
                keep_second: bool, dtype: torch.dtype) -> Tensor:
    """K from Jacobian blocks; the second batch's blocks are kept if ``keep_second``, else redone.

    With ``x2 is x1`` and kept blocks, each block is formed once.
    """
    result = _empty(x1, x2.shape[0], n_out, trace, dtype)
    second = list(_jacobians(jacobian, x2, chunk)) if keep_second else None
    first = second if second is not None and x2 is x1 else _jacobians(jacobian, x1, chunk)
    for b0, j1 in first:
        for c0, j2 in second if second is not None else _jacobians(jacobian, x2, chunk):
            b1, c1 = b0 + j1.shape[0], c0 + j2.shape[0]
            if trace:
                result[b0:b1, c0:c1] = torch.einsum("byp,cyp->bc", j1, j2)
            else:
                block = j1.reshape(-1, j1.shape[-1]) @ j2.reshape(-1, j2.shape[-1]).t()
                result[b0:b1, c0:c1] = block.view(j1.shape[0], n_out, j2.shape[0], n_out).permute(0, 2, 1, 3)
    return result


def products(model: nn.Module, jacobian: Jacobian, x1: Tensor, x2: Tensor, names: Sequence[str],
             params: Sequence[Tensor], n_out: int, trace: bool, chunk: int) -> Tensor:
    """K from rows of J(x1) pushed forward through f(x2), ``chunk`` samples of x1 at a time."""
    sizes = [p.numel() for p in params]
    z = torch.cat([p.detach().reshape(-1) for p in params])

    def f2(flat: Tensor) -> Tensor:
        named = {n: t.view(p.shape) for n, t, p in zip(names, flat.split(sizes), params)}
        return functional_call(clone_tree(model), named, (x2,)).reshape(x2.shape[0], n_out)

    push = vmap(lambda row: jvp(f2, (z,), (row,))[1], randomness="different")
    result = _empty(x1, x2.shape[0], n_out, trace, z.dtype)
    for b0, j1 in _jacobians(jacobian, x1, chunk):
        cols = push(j1.reshape(-1, z.numel())).view(j1.shape[0], n_out, x2.shape[0], n_out)
        b1 = b0 + j1.shape[0]
        if trace:
            result[b0:b1] = torch.diagonal(cols, dim1=1, dim2=3).sum(-1)
        else:
            result[b0:b1] = cols.permute(0, 2, 1, 3)
    return result


def _recorded(model: nn.Module, cov: probes.Coverage, x: Tensor, n_out: int) -> tuple[probes.Recording, list[Tensor]]:
    with torch.enable_grad():
        rec = probes.record(model, x, cov)
        eye = torch.eye(n_out, dtype=rec.output.dtype, device=rec.output.device)
        v = eye.unsqueeze(1).expand(n_out, x.shape[0], n_out).reshape(n_out, *rec.output.shape)
        return rec, rec.pullback(v)


def structured(model: nn.Module, cov: probes.Coverage, x1: Tensor, x2: Optional[Tensor], n_out: int,
               trace: bool) -> Tensor:
    """K per covered layer from its inputs and output cotangents (see the note; raises NotCovered)."""
    first = _recorded(model, cov, x1, n_out)
    second = first if x2 is None else _recorded(model, cov, x2, n_out)
    return layerio.gram(first, second, cov, trace)
