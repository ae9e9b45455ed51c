"""Primitive-op decompositions for torch functions whose own higher derivatives are wrong or missing.

The generic engines (nested jvp / vjp in ``_autodiff/nested.py``, and every engine of
``jacobian(..., create_graph=True)`` whose graph the user differentiates again) lean on torch's
derivative formulas. For a few fused ops those formulas are wrong above first order, without a
word; for others they raise (no forward-AD formula for a backward kernel, an in-place update inside
a formula). While :func:`exact` is active, a :class:`~torch.overrides.TorchFunctionMode` replaces
each registered function by the same computation written in primitive ops (mean, subtract, rsqrt,
LU factors, matmul, softmax), whose formulas are exact at every order. Each entry registers itself
next to its definition with ``@decomposes(...)`` under every spelling that reaches it.

NOTE: [Which torch formulas are wrong]
Measured in float64 on torch 2.13 at orders 1-4, every nesting of ``torch.func.jvp``,
``torch.func.grad`` and ``torch.autograd.grad(create_graph=True)``, against this decomposition and
central finite differences (docs/coverage.md has the table, tests/test_orders.py keeps it):
``layer_norm``, ``instance_norm`` and ``batch_norm`` with batch statistics are wrong from order 2
when forward mode is inside (forward-over-forward, reverse-over-forward) and from order 3 in
reverse-over-reverse; ``det``, ``slogdet``, ``logdet`` and ``linalg.solve`` (so ``solve_ex``, ``tensorsolve``) from
order 2 with forward mode inside; ``_weight_norm`` from order 2 in reverse-over-reverse. ``vector_norm`` (and
so ``Tensor.norm``, ``F.normalize``) and ``std`` / ``var`` are right but their forward-AD formulas
modify a saved tensor in place, so reverse mode over them (a ``create_graph`` gradient of a nested
jvp) raises; the flash kernel behind ``scaled_dot_product_attention`` has no derivative above first
order. softmax, log_softmax, group_norm, rms_norm and batch_norm with running statistics are right.

A mode only sees the outermost torch function of a call: inside a function that it passes through
(``F.multi_head_attention_forward`` calling ``scaled_dot_product_attention``), torch runs with the
mode switched off. Hence every spelling of an op is registered, and each decomposition is written
in primitives only. A decomposition returns ``NotImplemented`` for arguments it does not cover
(``out=``, dropout), and torch's own function runs.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

Decomposition = Callable[..., Any]
DECOMPOSITIONS: dict[Any, Decomposition] = {}


def decomposes(*spellings: Any) -> Callable[[Decomposition], Decomposition]:
    """Register ``fn`` as the decomposition of every spelling given (skipping those torch lacks)."""

    def register(fn: Decomposition) -> Decomposition:
        for spelling in spellings:
            if spelling is not None:
                DECOMPOSITIONS[spelling] = fn
        return fn

    return register


class _Decomposed(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rule = DECOMPOSITIONS.get(func)
        if rule is not None:
            out = rule(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def exact(active: bool = True) -> ContextManager[Any]:
    """Within the block, the registered torch functions run as their decompositions (a no-op
    context when not ``active``: it is entered on every call of the entry points)."""
    return _Decomposed() if active else contextlib.nullcontext()


def wanted(order: int = 1) -> bool:
    """Whether a generic engine computing derivatives of ``order`` needs the decompositions: above
    first order, when the result keeps a graph (grad mode on: ``create_graph``), or inside a
    torch.func transform (which will differentiate the result again)."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", lambda: None)
    return order > 1 or torch.is_grad_enabled() or peek() is not None


def _attr(name: str, owner: Any = torch) -> Any:
    return getattr(owner, name, None)


# Normalisation with statistics of the input


def _normalise(x: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    centred = x - x.mean(dims, keepdim=True)
    return centred * ((centred * centred).mean(dims, keepdim=True) + eps).rsqrt()


def _affine(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], shape: tuple[int, ...]) -> Tensor:
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


@decomposes(F.layer_norm)
def layer_norm(input: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    n = len(tuple(normalized_shape))
    y = _normalise(input, tuple(range(-n, 0)), eps)
    shape = tuple(input.shape[input.dim() - n:])
    return _affine(y, weight, bias, shape)


@decomposes(torch.layer_norm)
def _torch_layer_norm(input: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
                      bias: Optional[Tensor] = None, eps: float = 1e-5, cudnn_enable: bool = True) -> Tensor:
    return layer_norm(input, normalized_shape, weight, bias, eps)


def _channels(x: Tensor) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


@decomposes(F.batch_norm)
def batch_norm(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Any:
    if not training:
        return NotImplemented  # running statistics, an affine map: torch's formulas are exact
    if running_mean is not None or running_var is not None:  # torch's own update of the statistics
        with torch.no_grad():
            torch.batch_norm(input.detach(), None, None, running_mean, running_var, True, momentum, eps, False)
    y = _normalise(input, (0, *range(2, input.dim())), eps)
    return _affine(y, weight, bias, _channels(input))


@decomposes(torch.batch_norm)
def _torch_batch_norm(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                      running_mean: Optional[Tensor], running_var: Optional[Tensor], training: bool,
                      momentum: float, eps: float, cudnn_enabled: bool = False) -> Any:
    return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


@decomposes(F.group_norm)
def group_norm(input: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    # torch's formulas are right, but its kernel needs a contiguous input, which torch.func's batched
    # tangents need not be ("Expected X.is_contiguous", found by the differential harness under vmap)
    grouped = input.reshape(input.shape[0], num_groups, -1)
    y = _normalise(grouped, (-1,), eps).reshape(input.shape)
    return _affine(y, weight, bias, _channels(input))


@decomposes(F.instance_norm)
def instance_norm(input: Tensor, running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None,
                  weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Any:
    if not use_input_stats:
        return NotImplemented  # running statistics: an affine map
    if running_mean is not None or running_var is not None:
        with torch.no_grad():
            torch.instance_norm(input.detach(), None, None, running_mean, running_var, True, momentum, eps, False)
    y = _normalise(input, tuple(range(2, input.dim())), eps)
    return _affine(y, weight, bias, _channels(input))


@decomposes(torch.instance_norm)
def _torch_instance_norm(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                         running_mean: Optional[Tensor], running_var: Optional[Tensor], use_input_stats: bool,
                         momentum: float, eps: float, cudnn_enabled: bool = False) -> Any:
    return instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)


@decomposes(_attr("_weight_norm"))
def _weight_norm(v: Tensor, g: Tensor, dim: int = 0) -> Tensor:
    dims = tuple(d for d in range(v.dim()) if d != dim % max(v.dim(), 1)) if dim != -1 else tuple(range(v.dim()))
    return v * (g / (v * v).sum(dims, keepdim=True).sqrt())


# Norms and moments (right, but their forward-AD formulas break reverse mode over them)

Dims = Union[None, int, Sequence[int]]


def _dims(x: Tensor, dim: Dims) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.dim()))
    return (dim,) if isinstance(dim, int) else tuple(dim)


@decomposes(torch.linalg.vector_norm)
def vector_norm(x: Tensor, ord: Union[int, float] = 2, dim: Dims = None, keepdim: bool = False,
                *, dtype: Optional[torch.dtype] = None, out: Optional[Tensor] = None) -> Any:
    if out is not None or x.is_complex() or not isinstance(ord, (int, float)) or ord <= 0 or math.isinf(ord):
        return NotImplemented
    if dtype is not None:
        x = x.to(dtype)
    dims = _dims(x, dim)
    if ord == 2:
        return (x * x).sum(dims, keepdim=keepdim).sqrt()
    if ord == 1:
        return x.abs().sum(dims, keepdim=keepdim)
    return x.abs().pow(ord).sum(dims, keepdim=keepdim).pow(1.0 / ord)


@decomposes(torch.norm, torch.Tensor.norm)
def norm(x: Tensor, p: Any = "fro", dim: Dims = None, keepdim: bool = False, *rest: Any,
         out: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None) -> Any:
    if rest or out is not None or (isinstance(p, str) and p != "fro"):
        return NotImplemented  # the nuclear norm, or positional out/dtype (their order differs)
    return vector_norm(x, 2 if p in ("fro", None) else p, dim, keepdim, dtype=dtype)


@decomposes(torch.linalg.norm)
def linalg_norm(x: Tensor, ord: Any = None, dim: Dims = None, keepdim: bool = False, *,
                out: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None) -> Any:
    vector = (isinstance(dim, int) or (dim is not None and len(tuple(dim)) == 1)
              or (dim is None and (x.dim() == 1 or ord is None)))
    if not vector or isinstance(ord, str):
        return NotImplemented
    return vector_norm(x, 2 if ord is None else ord, dim, keepdim, dtype=dtype, out=out)


@decomposes(F.normalize)
def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Optional[Tensor] = None) -> Any:
    if out is not None:
        return NotImplemented
    n = vector_norm(input, p, dim, True)
    return NotImplemented if n is NotImplemented else input / n.clamp_min(eps)


def _moments(x: Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> Optional[tuple[Tensor, Tensor, bool]]:
    """(mean, var, keepdim) for every signature of torch.var / std / var_mean / std_mean, or None."""
    args, kwargs = list(args), dict(kwargs)
    if kwargs.pop("out", None) is not None:
        return None
    unbiased: Optional[bool] = None
    dim: Dims = kwargs.pop("dim", None)
    if args and isinstance(args[0], bool):  # var(x, unbiased)
        unbiased = args.pop(0)
    elif args:
        dim = args.pop(0)
    if args and isinstance(args[0], bool) and unbiased is None:  # var(x, dim, unbiased, keepdim)
        unbiased = args.pop(0)
    keepdim = bool(args.pop(0)) if args else bool(kwargs.pop("keepdim", False))
    unbiased = kwargs.pop("unbiased", unbiased)
    correction = kwargs.pop("correction", None)
    if args or kwargs or x.is_complex():
        return None
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    dims = _dims(x, dim)
    n = math.prod(x.shape[d] for d in dims) if dims else x.numel()
    mean = x.mean(dims, keepdim=True) if dims else x.mean()
    centred = x - mean
    var = (centred * centred).sum(dims, keepdim=keepdim) / max(n - correction, 0)
    return (mean if keepdim or not dims else mean.squeeze(dims)), var, keepdim


@decomposes(torch.var, torch.Tensor.var)
def var(x: Tensor, *args: Any, **kwargs: Any) -> Any:
    m = _moments(x, args, kwargs)
    return NotImplemented if m is None else m[1]


@decomposes(torch.std, torch.Tensor.std)
def std(x: Tensor, *args: Any, **kwargs: Any) -> Any:
    m = _moments(x, args, kwargs)
    return NotImplemented if m is None else m[1].sqrt()


@decomposes(torch.var_mean)
def var_mean(x: Tensor, *args: Any, **kwargs: Any) -> Any:
    m = _moments(x, args, kwargs)
    return NotImplemented if m is None else (m[1], m[0])


@decomposes(torch.std_mean)
def std_mean(x: Tensor, *args: Any, **kwargs: Any) -> Any:
    m = _moments(x, args, kwargs)
    return NotImplemented if m is None else (m[1].sqrt(), m[0])


# Determinants and solves through LU factors (torch's own LU formulas are exact)


def _lu(A: Tensor, singular: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """LU factors, pivots and the sign of the permutation (+-1, no gradient). With ``singular``, a
    singular A raises torch's error (unless under a torch.func transform, where it cannot be read)."""
    LU, pivots, info = torch.linalg.lu_factor_ex(A)
    if singular and not torch._C._functorch.is_functorch_wrapped_tensor(info) and bool((info > 0).any()):
        raise RuntimeError(f"{singular}: The solver failed because the input matrix is singular.")
    steps = torch.arange(1, A.shape[-1] + 1, device=A.device, dtype=pivots.dtype)
    swaps = (pivots != steps).sum(-1)
    return LU, pivots, 1 - 2 * (swaps % 2).to(A.dtype)


@decomposes(torch.linalg.det, torch.det, torch.Tensor.det)
def det(A: Tensor, *, out: Optional[Tensor] = None) -> Any:
    if out is not None or A.is_complex() or A.shape[-1] == 0:
        return NotImplemented
    LU, _, sign = _lu(A)
    return sign * LU.diagonal(dim1=-2, dim2=-1).prod(-1)


def _slogdet(A: Tensor) -> tuple[Tensor, Tensor]:
    LU, _, sign = _lu(A)
    diag = LU.diagonal(dim1=-2, dim2=-1)
    return sign * diag.sign().prod(-1), diag.abs().log().sum(-1)


@decomposes(torch.linalg.slogdet)
def linalg_slogdet(A: Tensor, *, out: Any = None) -> Any:
    if out is not None or A.is_complex() or A.shape[-1] == 0:
        return NotImplemented
    return torch.return_types.linalg_slogdet(_slogdet(A))  # type: ignore[attr-defined]


@decomposes(torch.slogdet, torch.Tensor.slogdet)
def slogdet(A: Tensor, *, out: Any = None) -> Any:
    if out is not None or A.is_complex() or A.shape[-1] == 0:
        return NotImplemented
    return torch.return_types.slogdet(_slogdet(A))


@decomposes(torch.logdet, torch.Tensor.logdet)
def logdet(A: Tensor) -> Any:
    if A.is_complex() or A.shape[-1] == 0:
        return NotImplemented
    sign, logabs = _slogdet(A)
    return torch.where(sign > 0, logabs, torch.where(sign == 0, -math.inf, math.nan))


@decomposes(torch.linalg.solve)
def solve(A: Tensor, B: Tensor, *, left: bool = True, out: Optional[Tensor] = None) -> Any:
    if out is not None or A.is_complex() or B.is_complex():
        return NotImplemented
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
    if vector:
        B = B.unsqueeze(-1) if left else B.unsqueeze(-2)
    LU, pivots, _ = _lu(A, singular="linalg.solve")
    X = torch.linalg.lu_solve(LU, pivots, B, left=left)
    return X.squeeze(-1 if left else -2) if vector else X


@decomposes(torch.linalg.solve_ex)
def solve_ex(A: Tensor, B: Tensor, *, left: bool = True, check_errors: bool = False, out: Any = None) -> Any:
    X = solve(A, B, left=left, out=out)
    if X is NotImplemented:
        return X
    info = torch.linalg.lu_factor_ex(A.detach())[2]
    return torch.return_types.linalg_solve_ex((X, info))  # type: ignore[attr-defined]


@decomposes(torch.linalg.tensorsolve)
def tensorsolve(A: Tensor, B: Tensor, dims: Optional[Sequence[int]] = None, *, out: Optional[Tensor] = None) -> Any:
    if dims is not None or out is not None:
        return NotImplemented
    x_shape = A.shape[B.dim():]
    X = solve(A.reshape(B.numel(), math.prod(x_shape)), B.reshape(B.numel()))
    return X.reshape(x_shape)


# Attention: the fused kernels have no derivatives above first order


@decomposes(F.scaled_dot_product_attention)
def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Any:
    if dropout_p > 0.0:
        return NotImplemented  # random: torch's own kernel draws the mask
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, -1) @ value
