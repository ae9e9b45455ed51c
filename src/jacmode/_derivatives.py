"""Derivative operators for physics-informed training, built on the engines."""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from . import _checks
from ._jacobian import jacobian


def derivative(
    f: Callable[[Tensor], Tensor],
    t: Tensor,
    order: int = 1,
    *,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    create_graph: bool = False,
) -> Tensor:
    """Per-sample derivative d^k y / dt^k for one scalar input per sample.

    Args:
        f: maps t of shape (B,) or (B, 1) to (B, *out).
        t: one scalar per sample, shape (B,) or (B, 1).
        order: k, the order of the derivative.
        structure: as in :func:`jacobian` ("auto" checks that samples are independent).
        chunk_size: as in :func:`jacobian`.
        create_graph: keep the result differentiable (for PINN losses).

    Returns:
        Shape (B, *out): d^k f(t)[b] / dt_b^k.

    Example:
        >>> import torch, jacmode as jm
        >>> t = torch.linspace(0, 1, 5)
        >>> jm.derivative(lambda t: t ** 3, t)     # 3 t^2
        tensor([0.0000, 0.1875, 0.7500, 1.6875, 3.0000])
    """
    _checks.check_input(t, wrt="inputs", batched=True, name="t")
    if not (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)):
        raise ValueError(
            f"t: expected one scalar per sample, shape (B,) or (B, 1), got {tuple(t.shape)}. "
            "For several input coordinates use jacmode.partial or jacmode.jacobian."
        )
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"order: expected a positive int, got {order!r}.")
    if order != 1:
        raise NotImplementedError("order > 1 is not implemented yet")
    jac = jacobian(f, t, mode="forward", structure=structure, chunk_size=chunk_size,
                   create_graph=create_graph)
    return jac.squeeze(-1) if t.dim() == 2 else jac


def partial(f: Callable[[Tensor], Tensor], x: Tensor, dims: tuple[int, ...], **kw: object) -> Tensor:
    """Per-sample mixed partial derivative along input coordinates ``dims`` (to be written)."""
    raise NotImplementedError


def hessian(f: Callable[[Tensor], Tensor], x: Tensor, **kw: object) -> Tensor:
    """Per-sample Hessian, (B, *out, D, D) (to be written)."""
    raise NotImplementedError


def laplacian(f: Callable[[Tensor], Tensor], x: Tensor, **kw: object) -> Tensor:
    """Per-sample Laplacian, (B, *out) (to be written)."""
    raise NotImplementedError


def divergence(f: Callable[[Tensor], Tensor], x: Tensor, **kw: object) -> Tensor:
    """Per-sample divergence of f: (B, D) -> (B, D), shape (B,) (to be written)."""
    raise NotImplementedError
