"""torch's loss modules as per-sample losses and per-sample output Hessians, for the products.

NOTE: [Per-sample terms of torch's losses]
Every supported torch loss, with any ``reduction``, is a sum over samples of terms that each
depend on one sample's output: ``loss(f(x), y) = sum_b c_b(f(x_b))`` with

    c_b = s * (sum over sample b's entries of the loss with reduction='none'),

s = 1 for 'sum' and 'none', and for 'mean' s = 1 / (what torch divides by): every entry of the
broadcast output for the elementwise losses (MSE, L1, Huber, BCE, BCEWithLogits), the B * prod(T)
positions for cross entropy with class probabilities, and the summed class weights of the
targets that are not ``ignore_index`` for class indices (the count of them without weights). s
depends on the targets only, so it is a constant of the batch. ``per_sample_grads`` returns
grad c_b (its rows sum to the gradient of torch's batch loss: BackPACK's BatchGrad convention) and
``ggn`` sums J_b^T (d^2 c_b / d f(x_b)^2) J_b (the GGN of torch's batch loss). Every call checks the
decomposition against the module itself, so a loss that does not split this way is refused, never
silently mis-scaled. See docs/products.md for the scale against BackPACK, curvlinops and Opacus.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.func import vmap

from ._threads import hessian  # one thread at a time: see [Threads] in _threads.py
ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.HuberLoss, nn.SmoothL1Loss, nn.BCELoss, nn.BCEWithLogitsLoss)
CLASSES = (nn.CrossEntropyLoss, nn.NLLLoss)
SUPPORTED = ELEMENTWISE + CLASSES

PerSample = Callable[[Tensor, Tensor], Tensor]


def is_torch_loss(loss: Any) -> bool:
    """Whether ``loss`` is one of torch's loss modules (``nn.modules.loss._Loss``)."""
    return isinstance(loss, nn.modules.loss._Loss)


def _scale(module: nn.Module, out: Tensor, y: Tensor) -> float:
    """s of the note: 1, or one over what torch's reduction='mean' divides by."""
    if module.reduction != "mean":
        return 1.0
    if isinstance(module, CLASSES) and not y.is_floating_point():  # class indices
        keep = y != module.ignore_index
        weight = module.weight
        total = keep.sum() if weight is None else weight[torch.where(keep, y, 0)][keep].sum()
        return 1.0 / float(total)
    if isinstance(module, CLASSES):  # class probabilities: one term per position
        return 1.0 / (out.numel() // out.shape[1])
    return 1.0 / torch.broadcast_shapes(out.shape, y.shape).numel()


def per_sample(module: nn.Module, out: Tensor, y: Tensor) -> PerSample:
    """``(out, y) -> (b,)``: the terms c_b of the note for any rows of this batch.

    ``out`` (B, *out) and ``y`` are the whole batch: they fix s, and the decomposition is
    checked against ``module(out, y)`` on them.

    Raises:
        ValueError: the module's loss is not the sum of these terms (then pass a callable).
    """
    unreduced = copy.copy(module)  # a shallow copy shares weight buffers; only its reduction differs
    setattr(unreduced, "reduction", "none")  # noqa: B010 -- a torch loss module attribute
    s = _scale(module, out, y)

    def terms(o: Tensor, t: Tensor) -> Tensor:
        v = unreduced(o, t)
        return v.reshape(v.shape[0], -1).sum(1) * s

    try:  # the engines evaluate one sample at a time: a weight shaped like the batch cannot follow
        alone = terms(out[:1], y[:1])
    except RuntimeError as exc:
        raise ValueError(
            f"loss: {type(module).__name__} cannot be evaluated on one sample alone ({str(exc).splitlines()[0][:100]}); "
            "a weight with one row per sample is the usual cause. Pass a callable `lambda out, y: ...` "
            "returning per-sample losses (B,), with per-sample weights carried in y."
        ) from exc
    mine, theirs = terms(out, y), module(out, y)
    if alone.shape != (1,) or not torch.allclose(alone, mine[:1], rtol=1e-6, atol=1e-6 * float(mine.abs().max())):
        raise ValueError(
            f"loss: {type(module).__name__} gives sample 0 a different loss alone than in the batch, so it is "
            "not a sum of per-sample terms. Pass a callable `lambda out, y: ...` returning per-sample losses (B,)."
        )
    if module.reduction == "none":
        mine, theirs = mine, theirs.reshape(theirs.shape[0], -1).sum(1)
    else:
        mine = mine.sum()
    tol = 1e-9 if out.dtype == torch.float64 else 1e-4
    if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=tol, atol=tol * float(theirs.abs().max())):
        raise ValueError(
            f"loss: {type(module).__name__}(reduction={module.reduction!r}) with these arguments is not a sum of "
            "per-sample terms as jacmode reads it (see docs/products.md). Pass a callable "
            "`lambda out, y: ...` returning per-sample losses (B,) instead."
        )
    return terms


def hessians(module: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    """(B, Y, Y): d^2 c_b / d f(x_b)^2 of every sample, by autograd through the module itself."""
    terms = per_sample(module, out, y)

    def one(o: Tensor, t: Tensor) -> Tensor:
        return terms(o.unsqueeze(0), t.unsqueeze(0))[0]

    h = vmap(hessian(one))(out.detach(), y)
    n_out = out[0].numel()
    return h.reshape(out.shape[0], n_out, n_out)


def closed_factor(module: nn.Module, out: Tensor, y: Tensor) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """The factor L (B, Y, Y) and signs (B, Y) or None of each sample's Hessian of c_b (see the note)
    in closed form, as the strings "mse" and "cross_entropy" have it; None where there is none
    (then :func:`hessians` differentiates the module twice).

    NOTE: [Closed-form factors of torch's losses]
    MSELoss: c_b = s * sum (f_b - y_b)^2, so H_b = 2 s I (targets shaped like f(x)). CrossEntropyLoss,
    with class indices or probabilities, weights, label smoothing and ``ignore_index``: per position
    t, c_bt = s * sum_c q_btc (-log softmax(f_bt)_c) with weights q >= 0 that depend on the targets
    only, whose Hessian is Q_bt (diag(p) - p p^T) with Q_bt = sum_c q_btc; since -log softmax(0)_c =
    log C, the module with ``reduction='none'`` at zero logits gives Q_bt log C. So L is the
    "cross_entropy" factor with each position's columns scaled by sqrt(s Q_bt). Both modules are sums of
    per-sample terms by construction (their weights are per class, not per sample), so the check of
    :func:`per_sample` is not run for them.

    Example:
        >>> out, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
        >>> L, signs = closed_factor(nn.CrossEntropyLoss(), out, y)
        >>> torch.allclose(L @ L.transpose(1, 2), hessians(nn.CrossEntropyLoss(), out, y))
        True
    """
    if out.dim() < 2:
        return None
    batch, n_out = out.shape[0], out[0].numel()
    if type(module) is nn.MSELoss and y.shape == out.shape:
        s = _scale(module, out, y)
        eye = torch.eye(n_out, dtype=out.dtype, device=out.device) * math.sqrt(2.0 * s)
        return eye.expand(batch, n_out, n_out), None
    if type(module) is nn.CrossEntropyLoss and out.shape[1] > 1:
        if (module.weight is None and module.label_smoothing == 0.0 and not y.is_floating_point()
                and not bool((y == module.ignore_index).any())):  # Q_bt = 1: the string's factor, scaled
            return cross_entropy_factor(out) * math.sqrt(_scale(module, out, y)), None
        unreduced = copy.copy(module)
        setattr(unreduced, "reduction", "none")  # noqa: B010 -- a torch loss module attribute
        classes = out.shape[1]
        q = unreduced(torch.zeros_like(out), y).reshape(batch, -1) * (_scale(module, out, y) / math.log(classes))
        cols = q[:, None, :].expand(batch, classes, q.shape[1]).reshape(batch, n_out)  # column (d, u): Q_bu
        L = cross_entropy_factor(out) * cols.abs().sqrt()[:, None, :]
        return L, (torch.sign(cols) if bool((cols < 0).any()) else None)
    return None


def cross_entropy_factor(out: Tensor) -> Tensor:
    """L (B, Y, Y) with L L^T = the Hessian of sum over positions of cross entropy, classes on dim 1.

    For out (B, C) one softmax; for out (B, C, *T) one per position, as torch's
    ``F.cross_entropy``: per position H_t = diag(p_t) - p_t p_t^T = L_t L_t^T with
    L_t = diag(sqrt p_t) - p_t sqrt(p_t)^T, and L is block diagonal over positions.
    """
    batch, classes = out.shape[0], out.shape[1]
    p = torch.softmax(out.reshape(batch, classes, -1), dim=1).transpose(1, 2)  # (B, T, C)
    s = p.sqrt()
    blocks = torch.diag_embed(s) - p[..., :, None] * s[..., None, :]  # (B, T, C, C)
    if p.shape[1] == 1:
        return blocks[:, 0]
    eye = torch.eye(p.shape[1], dtype=out.dtype, device=out.device)
    n_out = classes * p.shape[1]
    return torch.einsum("btcd,tu->bctdu", blocks, eye).reshape(batch, n_out, n_out)
