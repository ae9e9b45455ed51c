"""Rules for shape operations: views, reshapes, permutations, indexing, cat/stack/split/chunk.

A shape operation moves the entries of every sample the same way, so it applies to each Taylor
coefficient too, with one more dimension in front (the directions). Coefficients may have a batch
dimension of 1 (one seed shared by every sample), so reshapes are given the per-sample shape of
the result rather than the sizes the code asked for. The batch must stay dimension 0.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .base import Algebra, Traced, Unsupported, batch_kept, expand_batch, feature_dim


def regroup(name: str) -> Callable[..., Traced]:
    """view, reshape, flatten, squeeze, unsqueeze, expand: the per-sample entries keep their order."""

    def rule(alg: Algebra, x: Any, *args: Any, **kwargs: Any) -> Traced:
        if not isinstance(x, Traced):
            raise Unsupported(f"Tensor.{name} of a traced size")
        value = getattr(x.value, name)(*args, **kwargs)
        out = Traced(value, {})
        batch_kept(x, out, f"Tensor.{name}")
        shape = value.shape[1:]
        how = "expand" if name == "expand" else "reshape"
        if how == "reshape" and x.seed is not None and x._coef is None and value.dim() == 2:
            # an unbuilt seed flattened to (B, D): still the rows e_d ([Seeds as columns] in base.py)
            return Traced(value, None, coef_make=lambda: {k: c.reshape(*c.shape[:2], *shape) for k, c in x.coef.items()},
                          seed=x.seed)
        out.coef = {k: getattr(c, how)(*c.shape[:2], *shape) for k, c in x.coef.items()}
        return out

    return rule


def flatten_module(alg: Algebra, m: nn.Flatten, x: Traced) -> Traced:
    return regroup("flatten")(alg, x, m.start_dim, m.end_dim)


def identity(alg: Algebra, x: Any, *args: Any, **kwargs: Any) -> Any:
    return x


def detach(alg: Algebra, x: Traced) -> Traced:
    return Traced(x.value.detach(), {})


def permute(alg: Algebra, x: Traced, *dims: Any) -> Traced:
    order = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
    rank = x.value.dim()
    if not order or order[0] % rank != 0:
        raise Unsupported("Tensor.permute moves the batch dimension")
    shifted = (0, 1, *(feature_dim(d, rank, "Tensor.permute") for d in order[1:]))
    return Traced(x.value.permute(*order), {k: c.permute(*shifted) for k, c in x.coef.items()})


def transpose(alg: Algebra, x: Traced, dim0: int, dim1: int) -> Traced:
    rank = x.value.dim()
    a, b = feature_dim(dim0, rank, "transpose"), feature_dim(dim1, rank, "transpose")
    return Traced(x.value.transpose(dim0, dim1), {k: c.transpose(a, b) for k, c in x.coef.items()})


def getitem(alg: Algebra, x: Any, index: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return x[index]
    idx = index if isinstance(index, tuple) else (index,)
    if idx and idx[0] is Ellipsis:
        shifted = idx
    elif idx and isinstance(idx[0], slice) and idx[0] == slice(None):
        shifted = (slice(None), *idx)
    else:
        raise Unsupported("indexing that selects samples of the batch")
    out = Traced(x.value[index], {})
    batch_kept(x, out, "indexing")
    out.coef = {k: c[shifted] for k, c in x.coef.items()}
    return out


def _join(fn: Callable[..., Tensor], grow: int) -> Callable[..., Traced]:
    def rule(alg: Algebra, tensors: Any, dim: int = 0) -> Traced:
        items = list(tensors)
        rank = next(t.value.dim() for t in items if isinstance(t, Traced)) + grow
        d = feature_dim(dim, rank, fn.__name__)
        values = [t.value if isinstance(t, Traced) else t for t in items]
        out = Traced(fn(values, dim), {})
        keys = {k for t in items if isinstance(t, Traced) for k in t.coef}
        for key in keys:
            found = [t.coef.get(key) if isinstance(t, Traced) else None for t in items]
            parts = [c if c is not None else v.new_zeros(1, 1, *v.shape[1:]) for c, v in zip(found, values)]
            ref = expand_batch(parts)[0].shape[:2]
            out.coef[key] = fn([c.expand(*ref, *c.shape[2:]) for c in parts], d)
        return out

    return rule


def _pieces(name: str) -> Callable[..., tuple]:
    def rule(alg: Algebra, x: Traced, size: Any, dim: int = 0) -> tuple:
        d = feature_dim(dim, x.value.dim(), f"Tensor.{name}")
        values = getattr(x.value, name)(size, dim)
        coefs = {k: getattr(c, name)(size, d) for k, c in x.coef.items()}
        return tuple(Traced(v, {k: c[i] for k, c in coefs.items()}) for i, v in enumerate(values))

    return rule


TABLE: dict[Any, Callable[..., Any]] = {
    nn.Flatten: flatten_module, nn.Identity: lambda alg, m, x: x, operator.getitem: getitem,
    torch.permute: permute, ("method", "permute"): permute,
    torch.transpose: transpose, ("method", "transpose"): transpose,
    ("method", "contiguous"): identity, ("method", "clone"): identity, torch.clone: identity,
    ("method", "detach"): detach, torch.detach: detach,
    torch.cat: _join(torch.cat, 0), torch.concat: _join(torch.cat, 0), torch.stack: _join(torch.stack, 1),
    torch.split: _pieces("split"), ("method", "split"): _pieces("split"),
    torch.chunk: _pieces("chunk"), ("method", "chunk"): _pieces("chunk"),
}
for name in ("view", "reshape", "flatten", "squeeze", "unsqueeze", "expand"):
    TABLE[("method", name)] = regroup(name)
    if hasattr(torch, name):
        TABLE[getattr(torch, name)] = regroup(name)
