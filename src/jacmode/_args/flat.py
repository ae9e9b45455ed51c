"""The flat function of a call (:class:`Flat`) and the sub-batches engines take of it (:func:`take`).

See the note [Several arguments] in ``_args/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten

from .._state import Keyed

if TYPE_CHECKING:
    from .call import Call


Argnums = Union[int, tuple[int, ...]]
InDims = Union[None, int, Sequence[Optional[int]], dict[Union[str, int], Optional[int]]]


def children(spec: TreeSpec) -> list[TreeSpec]:
    """The specs of a pytree node's children (``TreeSpec.children()``; ``children_specs`` in older torch)."""
    method = getattr(spec, "children", None)
    return list(method() if method is not None else spec.children_specs)


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Leaf:
    """Where one differentiated tensor sits in z: columns [lo, lo + size) of each sample."""

    arg: int  # position among f's positional arguments
    index: int  # leaf index within that argument's pytree
    shape: tuple[int, ...]  # per-sample shape (the tensor's shape without dim 0 when batched)
    lo: int
    size: int


@dataclass
class Rider:
    """A tensor that is passed to f, not differentiated: batched with the samples or broadcast."""

    value: Tensor
    batched: bool


class Flat(Keyed):
    """f as a function of one flat tensor z: (b, D) -> (b, *out) or (b, Y) (see the note).

    Attributes:
        f: the user's function.
        batch: B, the number of samples of the call (riders are indexed by it).
        rows: the rows of the call's batch this flat function evaluates (None: all B).
    """

    def __init__(self, call: "Call", rows: Optional[Tensor] = None,
                 values: Optional[list[Tensor]] = None) -> None:
        self.call = call
        self.f = call.f
        self.batch = call.batch
        self.rows = rows  # rows of the call's batch (take), or None
        self.values = values  # replacements of the batched riders, in order (with_riders), or None
        self.__wrapped__ = call.f  # what _state.used_modules and the caches look through

    def subkey(self) -> tuple:
        """The call's structure, in the keys of the caches that keep this function's facts under f."""
        return self.call.signature()

    def _riders(self, b: int) -> list[Any]:
        call = self.call
        out = list(call.leaves)
        batched = [i for i, r in call.riders.items() if r.batched]
        if self.values is not None:
            for i, v in zip(batched, self.values):
                out[i] = v
            return out
        want = self.batch if self.rows is None else int(self.rows.numel())
        if call.batched and b != want and batched:
            raise RuntimeError(
                f"jacmode internal error: the flat function of a call with batched riders was evaluated on "
                f"{b} samples instead of {want} without selecting the rows (report this); as a work-around, "
                "pass the per-sample arguments through a closure or give them in_dims=None.")
        for i in batched:
            v = call.riders[i].value
            out[i] = v if self.rows is None else v.index_select(0, self.rows.to(v.device))
        return out

    def __call__(self, z: Tensor) -> Any:
        call = self.call
        leaves = self._riders(z.shape[0] if call.batched else 1)
        b = z.shape[0] if call.batched else None
        for leaf in call.diff:
            cols = z[..., leaf.lo:leaf.lo + leaf.size] if len(call.diff) > 1 else z
            shape = (b, *leaf.shape) if b is not None else leaf.shape
            leaves[leaf.index] = cols.reshape(shape)
        return call.flat_output(call.evaluate(leaves), b)


def traced_body(call: "Call") -> Callable[[Any, Any], Any]:
    """The flat function as ``body(z, riders)`` for graph capture (``_capture/capture.py``): the
    riders (:func:`inputs`) are an argument, so the captured program reads them on every run."""
    order = list(call.riders)

    def body(z: Any, riders: Any) -> Any:
        leaves = list(call.leaves)
        for i, j in enumerate(order):
            leaves[j] = riders[i]
        for leaf in call.diff:
            if len(call.diff) == 1:
                leaves[leaf.index] = z
                continue
            cols = z[:, leaf.lo:leaf.lo + leaf.size]  # (b, size): a reshape only where the leaf is not flat,
            leaves[leaf.index] = cols if leaf.shape == (leaf.size,) else cols.reshape(-1, *leaf.shape)  # (it
            # would give the seeds, shared by all samples, a batch dimension of b)
        out = call.evaluate(leaves)
        if call.has_aux:
            out = out[0]
        outs = tree_flatten(out)[0]
        if len(outs) == 1 and not isinstance(out, (tuple, list, dict)):
            return outs[0]
        return torch.cat([t.reshape(t.shape[0], -1) for t in outs], 1)

    return body


def take(fn: Any, rows: Union[Tensor, slice, int, Sequence[int]]) -> Any:
    """The flat function of a sub-batch: ``take(fn, idx)(z[idx])`` is ``fn(z)[idx]``.

    For a function that is not a :class:`Flat` (a call of one tensor), ``fn`` itself.
    """
    if not isinstance(fn, Flat) or not any(r.batched for r in fn.call.riders.values()):
        return fn
    base = torch.arange(fn.batch) if fn.rows is None else fn.rows
    if isinstance(rows, int):
        rows = [rows]
    sel = base[rows] if isinstance(rows, slice) else base[torch.as_tensor(rows, dtype=torch.long).reshape(-1)]
    return Flat(fn.call, sel)


def batched_riders(fn: Any) -> tuple[Tensor, ...]:
    """The batched riders of a flat function (its rows), in order; () for any other function.

    An engine that vmaps f over samples maps these along dim 0 with the samples and rebuilds the
    function of one sample with :func:`with_riders`::

        vmap(lambda zb, *rb: with_riders(fn, [r[None] for r in rb])(zb[None]))(z, *batched_riders(fn))
    """
    if not isinstance(fn, Flat):
        return ()
    leaves = fn._riders(fn.batch if fn.rows is None else int(fn.rows.numel()))
    return tuple(leaves[i] for i, r in fn.call.riders.items() if r.batched)


def inputs(fn: Any) -> tuple[Tensor, ...]:
    """Every tensor rider of a flat function (batched ones at its rows, broadcast ones as given), in
    leaf order: what a captured program of the call reads per run (``Program.bind``); ()
    for any other function."""
    if not isinstance(fn, Flat):
        return ()
    leaves = fn._riders(fn.batch if fn.rows is None else int(fn.rows.numel()))
    return tuple(leaves[i] for i in fn.call.riders)


def rows_of(fn: Any) -> Optional[int]:
    """How many samples a flat function with batched riders evaluates; None when any number will do."""
    if not isinstance(fn, Flat) or not any(r.batched for r in fn.call.riders.values()):
        return None
    if fn.values is not None:
        return int(fn.values[0].shape[0])
    return fn.batch if fn.rows is None else int(fn.rows.numel())


def with_riders(fn: Any, values: Sequence[Tensor]) -> Any:
    """``fn`` with its batched riders replaced by ``values`` (same order as :func:`batched_riders`)."""
    if not isinstance(fn, Flat) or not values:
        return fn
    return Flat(fn.call, None, list(values))
