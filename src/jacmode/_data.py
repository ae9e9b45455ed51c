"""Whole data sets: ``jacobians`` over batches, and the streaming behind ggn, ntk, per_sample_grads.

A data set is any iterable of batches (a ``DataLoader`` yielding ``x`` or ``(x, y)``, a list of
tensors). Per-sample results keep the rows one process iterating the batches would give them;
sums accumulate over batches; under ``torch.distributed`` every rank computes its share and gets
the whole result (see ``_streams/``).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Union, overload

import numpy as np
import torch
from torch import Tensor

from . import _checks
from ._checks import Wrt
from ._errors import BatchError, JacmodeWarning
from ._jacobian import jacobian
from ._streams import collective
from ._streams.batches import Piece, rows
from ._streams.pages import file_backed, release
from ._streams.rounds import Done, run_rounds

Out = Union[Tensor, np.ndarray]


def is_batches(x: Any) -> bool:
    """Whether ``x`` is a data set (an iterable of batches) rather than one tensor."""
    return not isinstance(x, (Tensor, str, bytes, dict)) and hasattr(x, "__iter__")


@overload
def jacobians(f: Callable[[Tensor], Tensor], batches: Iterable[Any], *, wrt: Wrt = ...,
              out: None = ..., progress: Optional[bool] = ..., mode: str = ...,
              chunk_size: Optional[int] = ..., max_memory: Any = ...) -> Iterator[Tensor]: ...
@overload
def jacobians(f: Callable[[Tensor], Tensor], batches: Iterable[Any], *, wrt: Wrt = ...,
              out: Out, progress: Optional[bool] = ..., mode: str = ...,
              chunk_size: Optional[int] = ..., max_memory: Any = ...) -> Out: ...
def jacobians(
    f: Callable[[Tensor], Tensor],
    batches: Iterable[Any],
    *,
    wrt: Wrt = "params",
    out: Optional[Out] = None,
    progress: Optional[bool] = None,
    mode: str = "auto",
    chunk_size: Optional[int] = None,
    max_memory: Any = None,
) -> Union[Iterator[Tensor], Out]:
    """Per-sample Jacobians over a whole data set, batch by batch: streamed, or written into ``out=``.

    Each batch is one :func:`jacmode.jacobian` call (flattened, same ``wrt``, ``mode``,
    ``chunk_size``, ``max_memory``); targets ``y`` of ``(x, y)`` batches are ignored.

    Without ``out=`` the result is a lazy iterator of per-batch Jacobians (B_i, Y, P); nothing is
    computed until it is iterated, and their concatenation is the Jacobian of the whole data set.
    With ``out=`` (N, Y, P), a tensor or a NumPy array (for instance a memmap from
    ``np.lib.format.open_memmap``), sample n is written into row n and ``out`` is returned;
    written pages of a file-backed ``out`` leave resident memory as the work goes (see
    docs/datasets.md). A batch that fails raises :class:`BatchError` naming it and the rows of
    ``out`` already final.

    Under ``torch.distributed`` (a process group initialised) every rank computes its share of
    the batches (a ``DistributedSampler``'s split, or batches rank, rank + R, ...) and every rank
    gets every row, as one process would (``all_gather``).

    Args:
        f: an ``nn.Module`` or a callable mapping x of shape (B, *in) to (B, *out).
        batches: an iterable of ``x`` or ``(x, y)`` batches, e.g. a ``DataLoader``.
        wrt: "params", a list of parameter names, or "inputs" (see :func:`jacmode.jacobian`).
        out: (N, Y, P) with N the number of samples, for ``wrt`` parameters.
        progress: None shows a tqdm bar (samples per second) when stderr is a terminal, True
            always (needs tqdm: ``pip install 'jacmode[progress]'``), False never.
        mode, chunk_size, max_memory: as in :func:`jacmode.jacobian`, per batch.

    Returns:
        Without ``out``: an iterator of (B_i, Y, P) tensors, one per batch (under
        ``torch.distributed`` with a ``DistributedSampler``, one per round of R batches).
        With ``out``: ``out``, filled.

    Example:
        >>> import torch, jacmode as jm
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        >>> loader = DataLoader(TensorDataset(torch.randn(10, 3), torch.randn(10, 2)), batch_size=4)
        >>> [J.shape for J in jm.jacobians(net, loader)]      # (B_i, Y, P), P = 32
        [torch.Size([4, 2, 32]), torch.Size([4, 2, 32]), torch.Size([2, 2, 32])]
        >>> out = jm.jacobians(net, loader, out=torch.empty(10, 2, 32))
        >>> torch.allclose(out, jm.jacobian(net, loader.dataset.tensors[0], wrt="params"), atol=1e-6)
        True
    """
    _checks.check_function(f)
    _checks.check_batches(batches, "batches")
    _checks.check_progress(progress)
    kw = dict(wrt=wrt, mode=mode, chunk_size=chunk_size, max_memory=max_memory)
    opts = _checks.check_options(batched=True, structure="auto", create_graph=False, flatten=True,
                                 **kw)
    if opts.wrt == "params":
        _checks.check_param_selection(f, opts.param_names)
    if out is None:
        return _stream(f, batches, progress, kw)
    target = _checks.check_rows_out(out)
    _into(target, batches, lambda p, dest: _flat(jacobian(f, p.x, out=dest, **kw)), progress,
          "jacobians")
    return out


def _flat(result: Union[Tensor, dict[str, Tensor]]) -> Tensor:
    assert isinstance(result, Tensor)  # flatten=True: always a tensor
    return result


def _stream(f: Callable[[Tensor], Tensor], batches: Iterable[Any], progress: Optional[bool],
            kw: dict[str, Any]) -> Iterator[Tensor]:
    compute = lambda p: _flat(jacobian(f, p.x, **kw))  # noqa: E731
    for done in run_rounds(batches, compute, gather=True, progress=progress, desc="jacobians"):
        done = sorted((d for d in done if d.value is not None), key=lambda d: d.start)
        if any(d.step > 1 for d in done):  # a DistributedSampler's round: one interleaved block
            base = done[0].start
            block = done[0].value.new_empty(  # type: ignore[union-attr]
                (sum(d.count for d in done), *done[0].value.shape[1:]))  # type: ignore[union-attr]
            for d in done:
                block[rows(d.start - base, d.step, d.count)] = d.value  # type: ignore[assignment]
            yield block
        else:
            yield from (d.value for d in done)  # type: ignore[misc]


def _into(out: Tensor, batches: Iterable[Any], compute: Callable[[Piece, Optional[Tensor]], Tensor],
          progress: Optional[bool], desc: str) -> None:
    """Write per-sample results into ``out`` row by row; say which rows are final on failure."""
    world, _ = collective.world()
    spill = file_backed(out)
    written = 0

    def run(piece: Piece) -> Tensor:
        if piece.start + piece.step * (piece.count - 1) >= len(out):
            raise ValueError(f"out: has {len(out)} rows but the data set has more samples "
                             f"(batch {piece.index} reaches row {piece.start + piece.count - 1}). "
                             "Allocate one row per sample.")
        dest = out[piece.start: piece.start + piece.count] if world == 1 else None
        return compute(piece, dest)

    try:
        for done in run_rounds(batches, run, gather=world > 1, progress=progress, desc=desc):
            for d in done:
                view = out[rows(d.start, d.step, d.count)]
                if d.value is not None and d.value.data_ptr() != view.data_ptr():
                    view.copy_(d.value)
                if spill and d.step == 1:
                    release(view)
                written = max(written, d.start + d.step * (d.count - 1) + 1)
    except BatchError as err:
        err.rows_written = written
        raise
    if written < len(out):
        warnings.warn(f"out: has {len(out)} rows but the data set had {written} samples; rows "
                      f"{written}.. were not written.", JacmodeWarning, stacklevel=3)


def rows_over(batches: Iterable[Any], compute: Callable[[Tensor, Optional[Tensor]], Tensor], *,
              progress: Optional[bool], desc: str) -> Tensor:
    """Per-sample results (B_i, ...) of every batch, stacked in the rows of the whole data set."""
    parts: list[Done] = []
    for done in run_rounds(batches, lambda p: compute(p.x, p.y), gather=True, progress=progress,
                           desc=desc):
        parts.extend(d for d in done if d.value is not None)
    if not parts:
        raise ValueError(f"{desc}: the data set yielded no samples; pass at least one batch.")
    n = max(d.start + d.step * (d.count - 1) + 1 for d in parts)
    first = parts[0].value
    assert first is not None
    result = first.new_empty((n, *first.shape[1:]))
    for d in parts:
        result[rows(d.start, d.step, d.count)] = d.value  # type: ignore[assignment]
    return result


def sum_over(batches: Iterable[Any], compute: Callable[[Tensor, Optional[Tensor]], Tensor], *,
             progress: Optional[bool], desc: str) -> Tensor:
    """The sum over batches of ``compute(x, y)`` (all ranks' batches under torch.distributed)."""
    total: Optional[Tensor] = None
    seen: dict[str, Any] = {}
    for done in run_rounds(batches, lambda p: compute(p.x, p.y), gather=False, progress=progress,
                           desc=desc, seen_like=seen):
        for d in done:
            if d.value is not None:
                total = d.value.clone() if total is None else total.add_(d.value)
    world, _ = collective.world()
    if world > 1:
        if total is None and seen.get("like") is not None:
            dtype, shape = seen["like"]
            total = torch.zeros(shape, dtype=dtype)
        if total is not None:
            total = collective.sum_over_ranks(total)
    if total is None:
        raise ValueError(f"{desc}: the data set yielded no samples; pass at least one batch.")
    return total
