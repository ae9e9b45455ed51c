"""Taylor rules for the pointwise losses of a PINN residual, per sample (``reduction='none'``).

mse_loss, l1_loss, smooth_l1_loss and huber_loss are s(input - target) for an elementwise s,
with a target that is a constant or another traced tensor (``sub`` carries both): the square, the
absolute value, and the piecewise quadratics, whose derivatives are written out here (Huber with
delta: d where |d| < delta, else delta sign(d); second derivative 1 inside, 0 outside; nothing
above; smooth L1 with beta is Huber with delta = beta divided by beta, and L1 at beta = 0). On a
kink the derivative is the one torch's own backward takes. A ``weight`` is left to the generic
engine. ``reduction='mean'`` or ``'sum'`` adds the losses of all samples into one number, so the
result couples the batch: no rule takes them, and jacmode's batch check refuses such an f with
``batched=True`` (a per-sample derivative of it does not exist).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import arithmetic
from .base import Algebra, Traced, Unsupported
from .elementwise import FUNCTIONS, Jet, _explicit


def _huber(delta: float, scale: float) -> Callable[[Tensor, int], Jet]:
    """``scale * huber_delta(h)`` to order n (see the module note)."""

    def jet(h: Tensor, n: int) -> Jet:
        inside = h.abs() < delta
        value = torch.where(inside, 0.5 * h * h, delta * (h.abs() - 0.5 * delta)) * scale
        d1 = torch.where(inside, h, delta * torch.sign(h)) * scale
        d2 = inside.to(h.dtype) * scale if n >= 2 else None
        return _explicit(value, [d1] + ([d2] if n >= 2 else []) + [None] * max(0, n - 2))

    return jet


def _difference(alg: Algebra, input: Any, target: Any, what: str, reduction: str,
                size_average: Optional[bool], reduce: Optional[bool]) -> Traced:
    if size_average is not None or reduce is not None:
        raise Unsupported(f"{what} with the deprecated size_average / reduce arguments")
    if reduction != "none":
        raise Unsupported(f"{what} with reduction={reduction!r} sums over the batch (it couples the samples)")
    if not isinstance(input, Traced) and not isinstance(target, Traced):
        raise Unsupported(f"{what} of constants")
    return arithmetic.sub(alg, input, target)


def _unweighted(what: str, weight: Optional[Tensor]) -> None:
    if weight is not None:
        raise Unsupported(f"{what} with a weight")


def mse_loss(alg: Algebra, input: Any, target: Any, size_average: Optional[bool] = None,
             reduce: Optional[bool] = None, reduction: str = "mean", weight: Optional[Tensor] = None) -> Traced:
    _unweighted("mse_loss", weight)
    d = _difference(alg, input, target, "mse_loss", reduction, size_average, reduce)
    return arithmetic.power(alg, d, 2.0)


def l1_loss(alg: Algebra, input: Any, target: Any, size_average: Optional[bool] = None,
            reduce: Optional[bool] = None, reduction: str = "mean", weight: Optional[Tensor] = None) -> Traced:
    _unweighted("l1_loss", weight)
    d = _difference(alg, input, target, "l1_loss", reduction, size_average, reduce)
    return alg.elementwise(d, lambda h, n: FUNCTIONS["abs"](None, h, n))


def smooth_l1_loss(alg: Algebra, input: Any, target: Any, size_average: Optional[bool] = None,
                   reduce: Optional[bool] = None, reduction: str = "mean", beta: float = 1.0) -> Traced:
    d = _difference(alg, input, target, "smooth_l1_loss", reduction, size_average, reduce)
    if beta == 0.0:
        return alg.elementwise(d, lambda h, n: FUNCTIONS["abs"](None, h, n))
    return alg.elementwise(d, _huber(float(beta), 1.0 / float(beta)))


def huber_loss(alg: Algebra, input: Any, target: Any, reduction: str = "mean", delta: float = 1.0,
               weight: Optional[Tensor] = None) -> Traced:
    _unweighted("huber_loss", weight)
    d = _difference(alg, input, target, "huber_loss", reduction, None, None)
    return alg.elementwise(d, _huber(float(delta), 1.0))


def _module(rule: Callable[..., Traced], *names: str) -> Callable[..., Traced]:
    def apply(alg: Algebra, m: nn.Module, input: Any, target: Any) -> Traced:
        return rule(alg, input, target, reduction=m.reduction, **{n: getattr(m, n) for n in names})

    return apply


TABLE: dict[Any, Callable[..., Traced]] = {
    F.mse_loss: mse_loss, F.l1_loss: l1_loss, F.smooth_l1_loss: smooth_l1_loss, F.huber_loss: huber_loss,
    nn.MSELoss: _module(mse_loss), nn.L1Loss: _module(l1_loss),
    nn.SmoothL1Loss: _module(smooth_l1_loss, "beta"), nn.HuberLoss: _module(huber_loss, "delta"),
}
