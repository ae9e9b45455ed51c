"""``F.embedding_bag`` in primitive ops, for the derivatives torch does not define.

NOTE: [EmbeddingBag in primitives]
torch's ``_embedding_bag`` has no forward-mode formula and its backward (``_embedding_bag_backward``)
has no derivative, so J v over an EmbeddingBag's weight (``jvp``, ``ggn(v=)``, ``linearize``:
forward mode, or the transpose of a vjp, which differentiates the backward) and the Hessian in
it (``hvp``) end in torch's NotImplementedError; torch.func fails the same way. The bag is linear
in the weight: out[b] = sum_t c[b, t] W[idx[b, t]], with c the per-sample weights (sum), 1 over
the count (mean), zero on ``padding_idx``; in mode max it selects one entry of W per column.
Under :func:`primitive_bags` (a torch function mode, entered by the vector products' calls of
a model that holds an EmbeddingBag) ``F.embedding_bag``, which ``nn.EmbeddingBag`` calls, is
evaluated as ``index_select``, a multiply and a sum (a ``gather`` at the maximum for max): ops
with every derivative, so each product is exact. Bags given by ``offsets`` of a 1-D input are
laid out as a padded (bags, longest bag) table first. ``max_norm`` (rewrites the weight during
the forward pass) and ``scale_grad_by_freq`` (a gradient that is not the derivative) are left
to torch, as are inputs torch itself refuses (it then says why).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_SIGNATURE = inspect.signature(F.embedding_bag)


def holds_bags(model: Any) -> bool:
    """Whether ``model`` (a module) holds an ``nn.EmbeddingBag``."""
    return isinstance(model, nn.Module) and any(isinstance(m, nn.EmbeddingBag) for m in model.modules())


class _PrimitiveBags(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict] = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding_bag:
            out = _decomposed(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def primitive_bags(active: bool = True) -> Iterator[None]:
    """A block in which ``F.embedding_bag`` runs in primitive ops (see the note); nothing when not ``active``."""
    if not active:
        yield
        return
    with _PrimitiveBags():
        yield


def _decomposed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Tensor]:
    """``F.embedding_bag(*args, **kwargs)`` in primitives, or None where torch's own op is to run."""
    try:
        call = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return None
    call.apply_defaults()
    a = call.arguments
    ids, weight, offsets, mode = a["input"], a["weight"], a["offsets"], a["mode"]
    psw, pad = a["per_sample_weights"], a["padding_idx"]
    if (not isinstance(ids, Tensor) or not isinstance(weight, Tensor) or weight.dim() != 2
            or not weight.is_floating_point() or ids.is_floating_point() or ids.dim() not in (1, 2)
            or a["max_norm"] is not None or a["scale_grad_by_freq"] or mode not in ("sum", "mean", "max")
            or (psw is not None and mode != "sum")):
        return None
    if ids.dim() == 2:
        if offsets is not None or (psw is not None and psw.shape != ids.shape):
            return None
        idx, keep, c = ids.long(), torch.ones(ids.shape, dtype=torch.bool, device=ids.device), psw
    else:
        if offsets is None or not isinstance(offsets, Tensor) or offsets.dim() != 1:
            return None
        if psw is not None and psw.shape != ids.shape:
            return None
        idx, keep, c = _table(ids.long(), offsets.long(), bool(a["include_last_offset"]), psw)
    if pad is not None:
        pad = pad + weight.shape[0] if pad < 0 else pad
        keep = keep & idx.ne(pad)
    n, length = idx.shape
    rows = weight.index_select(0, idx.reshape(-1)).reshape(n, length, weight.shape[1])
    m = keep.to(weight.dtype)
    if mode == "sum":
        w = m if c is None else c * m
        return (rows * w.unsqueeze(-1)).sum(1)
    if mode == "mean":
        return (rows * m.unsqueeze(-1)).sum(1) / m.sum(1).clamp(min=1).unsqueeze(-1)
    at = rows.detach().masked_fill(~keep.unsqueeze(-1), float("-inf")).argmax(1, keepdim=True)  # (n, 1, E)
    return rows.gather(1, at).squeeze(1) * keep.any(1).to(weight.dtype).unsqueeze(-1)


def _table(ids: Tensor, offsets: Tensor, include_last: bool, psw: Optional[Tensor]
           ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Bags of a 1-D input by offsets as a padded table: (ids, kept, per-sample weights), each (bags, longest)."""
    starts, end = (offsets[:-1], offsets[-1]) if include_last else (offsets, ids.numel())
    bags = starts.numel()
    pos = torch.arange(ids.numel(), device=ids.device)
    bag = torch.bucketize(pos, starts, right=True) - 1  # the last bag starting at or before each position
    valid = (bag >= 0) & (pos < end)
    bag = bag.clamp(min=0)
    within = pos - (starts[bag] if bags else pos)
    length = max(1, int(within[valid].max()) + 1) if bool(valid.any()) else 1
    where = (bag[valid], within[valid])
    idx = torch.zeros(bags, length, dtype=torch.long, device=ids.device).index_put(where, ids[valid])
    keep = torch.zeros(bags, length, dtype=torch.bool, device=ids.device).index_put(
        where, torch.ones((), dtype=torch.bool, device=ids.device))
    c = None if psw is None else psw.new_zeros(bags, length).index_put(where, psw[valid])
    return idx, keep, c
