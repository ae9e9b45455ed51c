"""Taylor rules for pooling: average pooling, adaptive or not (linear), and max pooling (a selection), 1d to 3d.

Average pooling is linear in its input: every coefficient is pooled the same way, its directions
and batch seen as one batch (``base.merged``). Max pooling picks one input entry per window, the
one torch's own ``max_pool`` returns the index of (the first of equal maxima): every coefficient is
gathered at those indices, so derivatives of any order are those of the selected entry (exact
wherever the maximum is unique, which is where the function is differentiable; at ties the result
is the derivative of the entry torch selects, as torch's own backward).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn.functional as F
from torch import Tensor, nn

from .base import Algebra, Traced, Unsupported, linear, merged

_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_MAX = {1: F.max_pool1d_with_indices, 2: F.max_pool2d_with_indices, 3: F.max_pool3d_with_indices}


def _traced(x: Any, what: str) -> Traced:
    if not isinstance(x, Traced):
        raise Unsupported(f"{what} of a traced kernel size")
    return x


def _avg(n: int) -> Callable[..., Traced]:
    pool = _AVG[n]

    def rule(alg: Algebra, x: Any, *args: Any, **kwargs: Any) -> Traced:
        x = _traced(x, f"avg_pool{n}d")
        if x.value.dim() != n + 2:
            raise Unsupported(f"avg_pool{n}d of an unbatched input")
        fn = lambda v: pool(v, *args, **kwargs)  # noqa: E731
        return linear(x, fn, merged(fn))

    return rule


def _max(n: int) -> Callable[..., Traced]:
    pool = _MAX[n]

    def rule(alg: Algebra, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
             ceil_mode: bool = False, return_indices: bool = False) -> Traced:
        x = _traced(x, f"max_pool{n}d")
        if return_indices:
            raise Unsupported(f"max_pool{n}d with return_indices")
        if x.value.dim() != n + 2:
            raise Unsupported(f"max_pool{n}d of an unbatched input")
        value, idx = pool(x.value, kernel_size, stride, padding, dilation, ceil_mode)
        flat = idx.flatten(2)  # (B, C, prod out): indices into the input's flattened spatial dims

        def gather(c: Tensor) -> Tensor:
            src = c.expand(c.shape[0], value.shape[0], *c.shape[2:]).flatten(3)  # (L, B, C, prod in)
            return src.gather(3, flat.expand(c.shape[0], *flat.shape)).reshape(c.shape[0], *value.shape)

        return Traced(value, {k: gather(c) for k, c in x.coef.items()})

    return rule


def _avg_module(alg: Algebra, m: nn.Module, x: Any) -> Traced:
    n = {nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3}[type(m)]
    kwargs = {"ceil_mode": m.ceil_mode, "count_include_pad": m.count_include_pad}
    if n > 1:
        kwargs["divisor_override"] = getattr(m, "divisor_override")
    return _avg(n)(alg, x, m.kernel_size, m.stride, m.padding, **kwargs)


_MAX_DIMS: dict[type, int] = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}


def _max_module(alg: Algebra, m: nn.Module, x: Any) -> Traced:
    n = _MAX_DIMS[type(m)]
    return _max(n)(alg, x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices)


def _adaptive(n: int) -> Callable[..., Traced]:
    pool = getattr(F, f"adaptive_avg_pool{n}d")

    def rule(alg: Algebra, x: Any, output_size: Any) -> Traced:
        x = _traced(x, f"adaptive_avg_pool{n}d")
        if x.value.dim() != n + 2:
            raise Unsupported(f"adaptive_avg_pool{n}d of an unbatched input")
        fn = lambda v: pool(v, output_size)  # noqa: E731
        return linear(x, fn, merged(fn))

    return rule


TABLE: dict[Any, Callable[..., Traced]] = {}
for _n in (1, 2, 3):
    TABLE[_AVG[_n]] = _avg(_n)
    TABLE[getattr(F, f"max_pool{_n}d")] = _max(_n)
    TABLE[_MAX[_n]] = _max(_n)
    TABLE[getattr(F, f"adaptive_avg_pool{_n}d")] = _adaptive(_n)
    TABLE[getattr(nn, f"AdaptiveAvgPool{_n}d")] = lambda alg, m, x, n=_n: _adaptive(n)(alg, x, m.output_size)
for _m in (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d):
    TABLE[_m] = _avg_module
for _mx in (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d):
    TABLE[_mx] = _max_module
