"""Per-sample gradients and the Gauss-Newton matrix, per layer where possible, generic otherwise.

NOTE: [Products without the Jacobian]
Per-sample gradients are J_b^T g_b with g_b = d loss_b / d f(x_b): for covered layers (see
``_probes/layerio.py``) one forward pass and one reverse pass of sum_b loss_b give each layer's
cotangent G (B, O) (samples are independent, so row b only depends on loss_b), and the weight
gradient of sample b is G_b (x) a_b, written straight into its slice of the (B, P) result
(Opacus's method). The reverse pass runs from the loss straight to the probes (not to the output
and then on), and asks autograd for nothing else; the blocks are written without the K dim of a
Jacobian's write (``layerwise.write_rows``: at B = 512 the weight block of a Linear on 2-D inputs is
one broadcast product into its columns, within a few % of a fill of them). The probed forward runs on a copy of x on the
first call of a signature, which shows whether the model modifies its input in place (its version
counter); later calls of a profile that says it does not run the model on x itself (at B = 512
on problem 1's class the copy is 1.6 MB, about 5% of the call). A later call that modifies x
after all (a model whose in-place writes depend on a flag the profile does not see) forgets the
profile; its rows are exact for the values the model saw when every column came from the
probes, else it raises, since x no longer holds the values asked for. A write through ``.data``
moves no version counter and is not seen. The parameters no rule covers get ``vmap(grad)`` of the per-sample loss over
``functional_call`` (their columns only; all of them when dropout is on, so that one mask is drawn).

The GGN is sum_b J_b^T H_b J_b with H_b = L_b S_b L_b^T (a factor with K columns and signs S = +-1:
the identity for MSE, diag(sqrt p) - p sqrt(p)^T for softmax cross-entropy, an eigendecomposition
for a callable). Its diagonal is sum_{b,k} s_bk (J_b^T l_bk)^2; for a Linear layer that is
(sum_k s G_k^2)^T (a^2) per weight, O(B*K*(I+O)) work and O(P) memory beyond one reverse pass of K
cotangents. The generic route forms J (B_chunk, Y, P) with :func:`jacmode.jacobian`, chunk by chunk,
multiplies by L and accumulates squares (diagonal) or (JL)^T S (JL) (full matrix); for the diagonal
it only runs for the parameters the probes do not cover.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from .._threads import clone_tree
from .. import _losses
from .._checks import check_hessians
from .._cache import warn_once
from .._rules.base import NotCovered
from . import layerio, layerwise, probes
from .._autodiff.reverse import recording

Factor = tuple[Tensor, Optional[Tensor]]  # L (B, Y, K), signs (B, K) or None (all +1)


def result_dtype(params: Sequence[Tensor]) -> torch.dtype:
    """The dtype of a product over ``params``: theirs, promoted where they differ; never the input's."""
    return functools.reduce(torch.promote_types, [p.dtype for p in params])


def factor_for(loss: Any, n_out: int, y: Optional[Tensor] = None) -> Callable[[Tensor], Factor]:
    """The symmetric factor L (B, Y, K) and signs of each sample's output Hessian H = L S L^T.

    ``loss``: "mse", "cross_entropy" (classes on dim 1, one softmax per position), one of torch's
    loss modules (with targets ``y``; see ``_losses.py``) or a callable out -> (B, Y, Y).
    """
    def factor(out: Tensor) -> Factor:
        if isinstance(loss, str) and loss == "mse":
            return torch.eye(n_out, dtype=out.dtype, device=out.device).expand(out.shape[0], n_out, n_out), None
        if isinstance(loss, str) and loss == "cross_entropy":
            return _losses.cross_entropy_factor(out if out.dim() > 1 else out.unsqueeze(1)), None
        if _losses.is_torch_loss(loss):
            assert y is not None  # checked by the entry point
            closed = _losses.closed_factor(loss, out, y)  # MSELoss, CrossEntropyLoss: as the strings
            if closed is not None:
                return closed
            h = _losses.hessians(loss, out, y)
        else:
            h = check_hessians(loss(out), out.shape[0], n_out)
        values, vectors = torch.linalg.eigh(0.5 * (h + h.transpose(1, 2)))
        return vectors * values.abs().sqrt()[:, None, :], torch.sign(values)
    return factor


def per_sample_grads_layers(model: nn.Module, cov: probes.Coverage, x: Tensor, losses: Callable[[Tensor], Tensor],
                            named: Sequence[tuple[str, Tensor]], result: Tensor, clone: bool = True) -> bool:
    """Write the covered columns of the (B, P) ``result``: one probed forward, one reverse pass.

    The reverse pass runs from sum_b loss_b straight to the probes (only their cotangents are
    needed; autograd computes no parameter gradient), which are the modules' outputs themselves
    until a call finds one of them modified in place after its module ran (``record``'s
    ``outputs``; that call raises NotCovered and the coverage then keeps the probes). ``clone``:
    see :func:`probes.record`. Returns whether the model modified its input in place. Raises
    NotCovered (nothing usable written) when a recorded input or output went stale.
    """
    outputs = not cov.found.get("rewritten", False)
    with torch.enable_grad():
        rec = probes.record(model, x, cov, clone=clone, outputs=outputs)
        loss = losses(rec.output)
        zs = [c.probe for c in rec.calls]
        grads: Sequence[Optional[Tensor]]
        if zs and loss.requires_grad:  # d(sum_b loss_b)/dz: the sum's cotangent, ones, given directly
            grads = torch.autograd.grad(loss, zs, torch.ones_like(loss), allow_unused=True)
        else:  # no probe, or a loss that does not depend on the output: zero rows, as torch.func's grad
            grads = (None,) * len(zs)
    if any(c.stale for c in rec.calls):
        raise NotCovered("a module input was modified in place after the call")
    if outputs and (any(c.rewritten for c in rec.calls) or len({id(z) for z in zs}) != len(zs)):
        cov.found["rewritten"] = True  # the next calls take probes; this one the generic engine
        raise NotCovered("a module output was modified in place after the call")
    gs = [g if g is not None else torch.zeros_like(z) for g, z in zip(grads, zs)]
    layerwise.write_rows(rec, gs, cov, named, result)
    return rec.modified


def per_sample_grads_generic(model: nn.Module, x: Tensor, y: Optional[Tensor], loss: Callable[..., Tensor],
                             named: Sequence[tuple[str, Tensor]], cols: dict[str, tuple[int, int]],
                             result: Tensor, chunk: int) -> None:
    """Write the columns of ``named`` in the (B, P) ``result`` by ``vmap(grad)`` of the per-sample loss."""
    def one(p: dict[str, Tensor], xb: Tensor, yb: Optional[Tensor]) -> Tensor:
        out = functional_call(clone_tree(model), p, (xb.unsqueeze(0),))
        value = loss(out) if yb is None else loss(out, yb.unsqueeze(0))
        return value.reshape(())

    primal = {n: p.detach() for n, p in named}
    step = vmap(grad(one), in_dims=(None, 0, None if y is None else 0), randomness="different")
    for b0 in range(0, x.shape[0], chunk):
        try:
            with recording() as kept:  # see [Grad mode of the reverse engines]
                g = step(primal, x[b0:b0 + chunk], None if y is None else y[b0:b0 + chunk])
                g = {n: kept(t) for n, t in g.items()}
        except RuntimeError as exc:  # vmap cannot batch f (fused RNN kernels, .item(), ...): loop instead
            warn_once(model, f"jacmode: per_sample_grads cannot vectorise f over samples "  # once per f: _cache.py
                             f"({str(exc).splitlines()[0][:120]}), so it loops over samples with autograd: exact, "
                             "only slower.")
            _loop(model, x[b0:], None if y is None else y[b0:], loss, named, cols, result[b0:])
            return
        for n in primal:
            lo, size = cols[n]
            result[b0:b0 + chunk, lo:lo + size] = g[n].reshape(g[n].shape[0], size)


def _loop(model: nn.Module, x: Tensor, y: Optional[Tensor], loss: Callable[..., Tensor],
          named: Sequence[tuple[str, Tensor]], cols: dict[str, tuple[int, int]], result: Tensor) -> None:
    """The columns of ``named`` for each sample alone: one forward and one ``autograd.grad`` per sample."""
    params = [p for _, p in named]
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        for b in range(x.shape[0]):
            # autograd even under torch.inference_mode(): the inputs are cloned into normal tensors
            # there, and the gradients are written into the result outside that block
            with torch.inference_mode(False), torch.enable_grad():
                xb = x[b:b + 1].clone()
                yb = None if y is None else y[b:b + 1].clone()
                out = model(xb)
                value = (loss(out) if yb is None else loss(out, yb)).reshape(())
                grads = torch.autograd.grad(value, params, allow_unused=True)
            for (n, p), g in zip(named, grads):
                lo, size = cols[n]
                result[b, lo:lo + size] = 0 if g is None else g.reshape(size)
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def ggn_diagonal_layers(model: nn.Module, cov: probes.Coverage, x: Tensor,
                        factor: Callable[[Tensor], Factor], named: Sequence[tuple[str, Tensor]]) -> Tensor:
    """(P,) GGN diagonal from one probed forward pass and one reverse pass of K cotangents."""
    with torch.enable_grad():
        rec = probes.record(model, x, cov)
        lf, signs = factor(rec.output.detach())
        v = lf.permute(2, 0, 1).reshape(lf.shape[2], *rec.output.shape)  # (K, B, *out)
        gs = rec.pullback(v)
    sums = layerio.sq_sum(rec, cov, gs, signs)
    return torch.cat([sums[n].reshape(-1) if n in sums else p.new_zeros(p.numel()) for n, p in named])


def ggn_generic(model: nn.Module, jacobian: Callable[[Tensor], Tensor], x: Tensor, factor: Factor,
                names: Sequence[str], n_params: int, diagonal: bool, chunk: int) -> Tensor:
    """(P,) diagonal or (P, P) GGN from Jacobian chunks of ``chunk`` samples (any model);
    ``jacobian``: the (b, Y, P) per-sample Jacobian of the parameters ``names`` at b samples."""
    lf, signs = factor
    dtype = result_dtype([p for n, p in model.named_parameters() if n in set(names)])
    result = torch.zeros((n_params,) if diagonal else (n_params, n_params), dtype=dtype, device=lf.device)
    for b0 in range(0, x.shape[0], chunk):
        jac = jacobian(x[b0:b0 + chunk])
        jl = torch.einsum("byp,byk->bkp", jac.to(dtype), lf[b0:b0 + chunk].to(dtype))  # (b, K, P): rows J_b^T l_bk
        weighted = jl if signs is None else jl * signs[b0:b0 + chunk, :, None].to(dtype)
        if diagonal:
            result += (weighted * jl).sum((0, 1))
        else:
            result += weighted.reshape(-1, n_params).t() @ jl.reshape(-1, n_params)
    return result
