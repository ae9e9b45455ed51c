"""Whole data sets: ``jacobians`` over batches, and the streaming behind ggn, ntk, per_sample_grads.

A data set is any iterable of batches (a ``DataLoader`` yielding ``x`` or ``(x, y)``, a generator,
a list of ``(x,)`` or ``(x, y)`` tuples) that is not a tensor, nor a tuple or list holding tensors:
those are refused (``_checks.check_not_arguments``), never read as batches. Per-sample results
keep the rows one process iterating the batches would give them; sums accumulate over batches;
under ``torch.distributed`` every rank computes its share and gets the whole result (see
``_streams/``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Union, overload

import numpy as np
import torch
from torch import Tensor

from . import _checks, _losses
from ._args import Argnums, InDims
from ._checks import Wrt
from ._jacobian import jacobian
from ._streams import collective
from ._streams.batches import distributed_sampler, rows, unpack
from ._streams.collect import into, rows_over, sum_over
from ._streams.rounds import run_rounds

Out = Union[Tensor, np.ndarray]


def is_batches(x: Any, name: str = "x") -> bool:
    """Whether ``x`` is a data set (an iterable of batches) rather than one tensor.

    A tuple or list holding tensors is neither: a TypeError says how to pass it (otherwise a
    model's ``(x, mask)`` would be read as a data set of two batches).
    """
    _checks.check_not_arguments(x, name)
    return not isinstance(x, (Tensor, str, bytes, dict)) and hasattr(x, "__iter__")


@overload
def jacobians(f: Callable[..., Any], batches: Iterable[Any], *, n_args: Optional[int] = ...,
              argnums: Argnums = ..., in_dims: InDims = ..., kwargs: Optional[dict[str, Any]] = ...,
              wrt: Wrt = ..., out: None = ..., progress: Optional[bool] = ..., mode: str = ...,
              chunk_size: Optional[int] = ..., max_memory: Any = ...) -> Iterator[Any]: ...
@overload
def jacobians(f: Callable[..., Any], batches: Iterable[Any], *, n_args: Optional[int] = ...,
              argnums: Argnums = ..., in_dims: InDims = ..., kwargs: Optional[dict[str, Any]] = ...,
              wrt: Wrt = ..., out: Out, progress: Optional[bool] = ..., mode: str = ...,
              chunk_size: Optional[int] = ..., max_memory: Any = ...) -> Out: ...
def jacobians(
    f: Callable[..., Any],
    batches: Iterable[Any],
    *,
    n_args: Optional[int] = None,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
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
        batches: an iterable of ``x`` or ``(x, y)`` batches: a ``DataLoader``, a generator,
            ``iter([x1, x2])`` or a list of ``(x,)`` tuples. A tuple or list holding tensors
            (``x.split(4)``, ``(x, mask)``) raises a TypeError: wrap it in ``iter(...)``. With
            ``n_args=k`` each batch is a tuple whose first k entries are f's positional arguments
            (a ``DataLoader`` over ``TensorDataset(x, mask, y)`` with ``n_args=2``).
        n_args: None (each batch is ``x`` or ``(x, y)``), or how many leading entries of each
            batch are f's positional arguments; the rest (targets) are ignored.
        argnums: with ``n_args`` and ``wrt="inputs"``, the differentiated arguments (see
            :func:`jacmode.jacobian`).
        in_dims: with ``n_args``, how each argument is passed (see :func:`jacmode.jacobian`).
        kwargs: keyword arguments for f, passed through for every batch.
        wrt: "params", a list of parameter names, or "inputs" (see :func:`jacmode.jacobian`).
        out: (N, Y, P) with N the number of samples, for ``wrt`` parameters.
        progress: None shows a tqdm bar (samples per second) when stderr is a terminal, True
            always (needs tqdm: ``pip install 'jacmode[progress]'``), False never.
        mode: as in :func:`jacmode.jacobian`, for each batch.
        chunk_size: as in :func:`jacmode.jacobian`, for each batch.
        max_memory: as in :func:`jacmode.jacobian`, for each batch.

    Returns:
        Without ``out``: an iterator of (B_i, Y, P) tensors (for several arguments with
        ``wrt="inputs"``, of torch.func's layout, see :func:`jacmode.jacobian`), one per batch (under
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
        >>> masked = lambda x, m: net(x * m)                 # two arguments per batch, then targets
        >>> data = DataLoader(TensorDataset(torch.randn(10, 3), torch.ones(10, 3), torch.randn(10, 2)), batch_size=4)
        >>> [J.shape for J in jm.jacobians(masked, data, n_args=2, wrt="inputs")]
        [torch.Size([4, 2, 3]), torch.Size([4, 2, 3]), torch.Size([2, 2, 3])]
    """
    _checks.check_function(f)
    _checks.check_batches(batches, "batches")
    _checks.check_progress(progress)
    if n_args is not None:
        return _jacobians_of_arguments(f, batches, n_args, argnums, in_dims, kwargs, wrt, out, progress, mode,
                                       chunk_size, max_memory)
    if kwargs is not None or argnums != 0 or in_dims != 0:
        raise ValueError("n_args: argnums, in_dims and kwargs apply to batches of several arguments; pass n_args=k "
                         "(the number of f's positional arguments at the head of each batch).")
    kw = dict(wrt=wrt, mode=mode, chunk_size=chunk_size, max_memory=max_memory)
    opts = _checks.check_options(batched=True, structure="auto", create_graph=False, flatten=True,
                                 **kw)
    if opts.wrt == "params":
        _checks.check_param_selection(f, opts.param_names)
    if out is None:
        return _stream(f, batches, progress, kw)
    if opts.wrt != "params":
        raise ValueError("out: only supported for parameter Jacobians (wrt='params' or a list of "
                         "names); iterate jm.jacobians(f, batches, wrt='inputs') instead.")
    target = _checks.check_rows_out(out)
    into(target, batches, lambda p, dest: _flat(jacobian(f, p.x, out=dest, **kw)), progress,
          "jacobians")
    return out


def _jacobians_of_arguments(f: Any, batches: Iterable[Any], n_args: Any, argnums: Any, in_dims: Any, kwargs: Any,
                            wrt: Any, out: Any, progress: Any, mode: Any, chunk_size: Any,
                            max_memory: Any) -> Union[Iterator[Any], Out]:
    """:func:`jacobians` over batches whose first ``n_args`` entries are f's positional arguments."""
    if isinstance(n_args, bool) or not isinstance(n_args, int) or n_args < 1:
        raise TypeError(f"n_args: expected a positive int (f's positional arguments per batch), got {n_args!r}.")
    opts = _checks.check_options(batched=True, structure="auto", create_graph=False, flatten=True, wrt=wrt,
                                 mode=mode, chunk_size=chunk_size, max_memory=max_memory)
    if opts.wrt == "params":
        _checks.check_param_selection(f, opts.param_names)
    kw = dict(wrt=wrt, mode=mode, chunk_size=chunk_size, max_memory=max_memory, in_dims=in_dims, kwargs=kwargs)
    if opts.wrt == "inputs":
        kw["argnums"] = argnums

    def arguments(p: Any) -> tuple[Any, ...]:
        item = p.item
        if not isinstance(item, (tuple, list)) or len(item) < n_args:
            raise TypeError(
                f"batches: batch {p.index} is {type(item).__name__}"
                + (f" of {len(item)} entries" if isinstance(item, (tuple, list)) else "")
                + f", but n_args={n_args} needs a tuple whose first {n_args} entries are f's arguments.")
        return tuple(item[:n_args])

    if out is None:
        if opts.wrt == "params":  # tensors: gathered over ranks as one-argument batches are
            return _stream(f, batches, progress, kw, lambda p: _flat(jacobian(f, *arguments(p), **kw)))
        compute: Any = lambda p: jacobian(f, *arguments(p), **kw)  # noqa: E731  -- pytrees: this rank's own batches
        return (d.value for done in run_rounds(batches, compute, gather=False, progress=progress, desc="jacobians")
                for d in sorted((d for d in done if d.value is not None), key=lambda d: d.start))
    if opts.wrt != "params":
        raise ValueError("out: only supported for parameter Jacobians (wrt='params' or a list of "
                         "names); iterate jm.jacobians(f, batches, wrt='inputs') instead.")
    target = _checks.check_rows_out(out)
    into(target, batches, lambda p, dest: _flat(jacobian(f, *arguments(p), out=dest, **kw)), progress, "jacobians")
    return out


def _flat(result: Union[Tensor, dict[str, Tensor]]) -> Tensor:
    assert isinstance(result, Tensor)  # flatten=True: always a tensor
    return result


def _stream(f: Callable[..., Any], batches: Iterable[Any], progress: Optional[bool],
            kw: dict[str, Any], compute: Optional[Callable[[Any], Tensor]] = None) -> Iterator[Tensor]:
    if compute is None:
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


# --- per_sample_grads, ntk, ggn over data sets: the thin dispatch of _products.py lands here ---

def _product_checks(f: Any, batches: Any, name: str, progress: Any, **kw: Any) -> None:
    """Validate what can be validated before the first batch is read."""
    _checks.check_function(f)
    _checks.check_batches(batches, name)
    _checks.check_progress(progress)
    opts = _checks.check_product_options(**kw)
    _checks.check_param_selection(f, opts.param_names)


def per_sample_grads_over(per_sample_grads: Callable[..., Any], f: Any, batches: Iterable[Any],
                          loss: Callable[..., Tensor], *, y: Optional[Tensor], flatten: bool,
                          progress: Optional[bool], **kw: Any) -> Union[Tensor, dict[str, Tensor]]:
    """per_sample_grads over a data set: (N, P) rows in data set order; targets from (x, y) batches."""
    _product_checks(f, batches, "x", progress, flatten=flatten, **kw)
    _checks.check_loss(loss)
    if y is not None:
        raise ValueError("y: with a data set as x, the targets come from its (x, y) batches; "
                         "drop y= (or yield (x, y) tuples, e.g. a DataLoader over TensorDataset(x, y)).")
    flat = rows_over(batches, lambda xb, yb: per_sample_grads(f, xb, loss, y=yb, **kw),
                     progress=progress, desc="per_sample_grads")
    if flatten:
        return flat
    selected = _checks.check_param_selection(f, _checks.check_product_options(**kw).param_names)
    blocks = flat.split([p.numel() for _, p in selected], dim=1)
    return {n: t.reshape(len(flat), *p.shape) for (n, p), t in zip(selected, blocks)}


def ggn_over(ggn: Callable[..., Tensor], f: Any, batches: Iterable[Any], loss: Any, *, y: Optional[Tensor],
             progress: Optional[bool], **kw: Any) -> Tensor:
    """ggn over a data set: the sum over batches (all_reduce over ranks); targets from (x, y)
    batches for torch's loss modules (each batch's loss as torch defines it for that batch)."""
    diagonal = kw.pop("diagonal")
    _product_checks(f, batches, "x", progress, **kw)
    _checks.check_ggn_loss(loss, diagonal)
    if y is not None:
        raise ValueError("y: with a data set as x, the targets come from its (x, y) batches; "
                         "drop y= (or yield (x, y) tuples, e.g. a DataLoader over TensorDataset(x, y)).")
    targets = _losses.is_torch_loss(loss)
    return sum_over(batches, lambda xb, yb: ggn(f, xb, loss, y=yb if targets else None, diagonal=diagonal, **kw),
                    progress=progress, desc="ggn")


def _columns(x2: Any, name: str) -> Callable[[], Iterator[Tensor]]:
    """Every batch of the column side of a Gram matrix, re-readable, on every rank."""
    world, _ = collective.world()
    if world > 1 and distributed_sampler(x2) is not None:
        raise ValueError(f"{name}: the columns of the kernel need every sample on every rank, but "
                         "this DataLoader has a DistributedSampler. Pass x2 = a DataLoader over "
                         "the same data set without the sampler.")
    if iter(x2) is x2:
        raise ValueError(f"{name}: a one-shot iterator cannot be read once per block of rows; "
                         "pass a DataLoader or a list of (x,) tuples.")
    return lambda: (unpack(item, i)[0] for i, item in enumerate(x2))


def ntk_over(ntk: Callable[..., Tensor], f: Any, x1: Any, x2: Any, *, trace: bool,
             progress: Optional[bool], **kw: Any) -> Tensor:
    """ntk with x1 and/or x2 data sets: Gram blocks, rows of x1's batches split over ranks."""
    method = kw.pop("method")
    one, two = is_batches(x1, "x1"), x2 is not None and is_batches(x2, "x2")
    _product_checks(f, x1 if one else x2, "x1" if one else "x2", progress, **kw)

    def block(a: Tensor, b: Tensor) -> Tensor:
        return ntk(f, a, b, method=method, trace=trace, **kw)

    if one:
        if x2 is not None and not two:
            return rows_over(x1, lambda xb, _: block(xb, x2), progress=progress, desc="ntk")
        cols = _columns(x1 if x2 is None else x2, "x1" if x2 is None else "x2")
        return rows_over(x1, lambda xb, _: torch.cat([block(xb, c) for c in cols()], dim=1),
                         progress=progress, desc="ntk")
    _checks.check_input(x1, wrt="params", batched=True, name="x1")
    k = rows_over(x2, lambda xb, _: block(xb, x1), progress=progress, desc="ntk")  # K(x2, x1)
    return (k.transpose(0, 1) if trace else k.permute(1, 0, 3, 2)).contiguous()
