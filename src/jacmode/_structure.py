"""Seeds and assembly for each strategy: what the directions are and where their products go.

Every strategy writes a flat result: (B, Y, N) when batched, (Y, N) when not, (numel(x),) for the
elementwise diagonal. Forward mode fills columns n, reverse mode fills rows y.

* broadcast: independent samples; direction d is e_d on every sample at once, so D tangents
  (or Y cotangents) give every diagonal block (see design.md, "structure is compression").
  When the model's captured graph has a rule for every operation (``_capture/capture.py``),
  forward mode pushes the tangents op by op (``_forward.layerwise_columns``), the PINN networks'
  fast path.
* per-sample: vmap over samples of vmap over outputs of vjp (parameters, independent samples);
  for parameters that the per-module rules cover, the layer-wise probe engine
  (``_probes/layerwise.py``, ``_probes/generated.engine``), with the generic engine for the parameters no rule covers.
* whole-batch: the batch is one point; directions are one-hot over (b, d) or (b, y) and only the
  diagonal block of each product is kept. Exact with coupled samples. For parameters in forward
  mode, each tangent is shared by all samples and gives a whole column at once.
* full: unbatched; one-hot directions over all of x or all of f(x).
* diagonal: elementwise f; one tangent (or cotangent) of ones gives the diagonal.

NOTE: [Memory of chunked results]
Blocks are written into one preallocated result (or the caller's ``out=``); a single chunk that
covers everything is returned without the copy. Per-sample parameter blocks are kept to a few MB
so that the allocator re-uses their memory from chunk to chunk.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ._probes import generated
from ._capture.capture import reject
from ._autodiff.fallback import translated_warnings
from ._autodiff.forward import forward_columns, layerwise_columns
from ._autodiff.reverse import per_sample_rows, reverse_rows, sample_rows
from ._planning.plan import Plan
from ._problem import Problem, own_input
from ._rules.base import NotCovered, Unsupported
from ._state import RngReplay
from ._transforms import in_transform


def one_hot(start: int, stop: int, n: int, like: Tensor) -> Tensor:
    """Rows start..stop-1 of the n x n identity, without building the identity."""
    k = stop - start
    out = torch.zeros(k, n, dtype=like.dtype, device=like.device)
    out[torch.arange(k, device=like.device), torch.arange(start, stop, device=like.device)] = 1
    return out


class _Result:
    """A result filled block by block; a block covering everything is kept as it is."""

    def __init__(self, shape: tuple[int, ...], like: Tensor, out: Optional[Tensor]) -> None:
        self.shape, self.like, self.out = shape, like, out
        self.value: Optional[Tensor] = out

    def target(self) -> Tensor:
        if self.value is None:
            self.value = self.like.new_empty(self.shape)  # every entry is written
        return self.value

    def whole(self, block: Tensor) -> bool:
        """Keep ``block`` as the result if nothing was preallocated; True if kept."""
        if self.value is None:
            self.value = block
            return True
        return False

    def keep(self, block: Tensor) -> None:
        self.value = block

    def put(self, key: Any, block: Tensor, view: Optional[tuple[int, ...]] = None) -> None:
        """``target()[key] = block`` (``target().view(view)[key]`` when ``view`` is given).

        Inside a torch.func transform (a user's vmap over calls of jacmode) the block may be batched
        by that transform while the result, allocated from the unbatched parameters, is not; an
        in-place write of the one into the other is refused by vmap, so there the block goes in
        out of place (``index_put`` over the flat positions of ``key``), which vmap batches.
        """
        t = self.target()
        if not in_transform() or self.out is not None:
            (t if view is None else t.view(view))[key] = block
            return
        where = torch.arange(t.numel(), device=t.device).view(t.shape if view is None else view)[key]
        flat = t.reshape(-1).index_put((where.reshape(-1),), block.expand(where.shape).reshape(-1))
        self.value = flat.view(t.shape)


def run(p: Problem, plan: Plan, out: Optional[Tensor] = None, fallback: bool = True) -> Tensor:
    """Run the plan's strategy and return the flat result (see module docstring).

    ``fallback=False``: where Taylor mode over the captured program finds a rule's assumption
    broken, raise its ``Unsupported`` (the program rejected for these inputs) instead of running
    the generic engine, which runs f: for a caller that runs no state guard (``_jacobian``'s
    repeated pure-program call), and then calls again with one."""
    rng = RngReplay(p.device) if p.random else None
    if plan.strategy == "per-sample" and p.probes is not None:
        try:
            return generated.engine(p, plan, out)  # reads the parameters, not z (made lazily)
        except NotCovered:
            pass  # the generic engine below, for every parameter
    B, N, Y, z = p.batch, p.n_in, p.n_out, p.z
    forward = plan.mode == "forward"
    step = plan.chunk_size
    engine = forward_columns if forward else reverse_rows

    if plan.strategy == "diagonal":
        res = _Result(tuple(z.shape), z, None)
        seeds = lambda s, e: torch.ones_like(z).unsqueeze(0)  # noqa: E731
        engine(p.fn, z, 1, seeds, lambda s, e, blk: res.keep(blk[0]), 1, rng)
        return res.target()

    if plan.strategy == "per-sample":
        res = _Result((B, Y, N), z, out)

        def place_rows(b0: int, b1: int, y0: int, y1: int, blk: Tensor) -> None:
            if not (b0 == 0 and b1 == B and y0 == 0 and y1 == Y and res.whole(blk)):
                res.put((slice(b0, b1), slice(y0, y1)), blk)

        assert p.sample_fn is not None and plan.sample_chunk is not None
        per_sample_rows(p.sample_fn, z, p.x, Y, place_rows, plan.sample_chunk, step, rng)
        return res.target()

    shape = (B, Y, N) if p.batched else (Y, N)
    res = _Result(shape, z, out)
    if plan.strategy == "whole-batch" and in_transform() and not (forward and p.kind == "params"):
        return _whole_batch_functional(p, plan, engine, res, rng)
    seeds, place = _SEEDS[(plan.strategy, forward, p.kind == "params")](p, res, plan.directions)
    if forward and plan.strategy == "broadcast" and p.program is not None:
        try:
            layerwise_columns(p.program, p.in_shape, z, plan.directions, place, step)
            return res.target()
        except Unsupported as err:  # a rule's assumption broke at this size: the generic engine
            reject(p.program, p.x, str(err))
            if not fallback:
                raise
            own_input(p)  # f runs now: never on x itself
            with translated_warnings():  # execute enters none for this engine (it runs no vmap)
                engine(p.fn, p.z, plan.directions, seeds, place, step, rng)
            return res.target()
    if not forward and plan.strategy == "broadcast" and _rows_per_sample(p):
        def place_sample_rows(s: int, e: int, blk: Tensor) -> None:
            if not (s == 0 and e == Y and res.whole(blk)):
                res.put((slice(None), slice(s, e)), blk)

        assert p.row_fn is not None and p.program is not None
        try:  # rows in the result's layout (see sample_rows)
            sample_rows(p.row_fn, z, Y, place_sample_rows, step)
            return res.target()
        except Exception as err:  # noqa: BLE001 -- f on one sample under vmap: the batch engine below
            p.program.checked[_ROWS_KEY + _shape_key(p)] = f"{type(err).__name__}: {err}"
            res = _Result(shape, z, out)  # nothing of it is kept (out= is written over)
            seeds, place = _SEEDS[(plan.strategy, forward, False)](p, res, plan.directions)
    engine(p.fn, z, plan.directions, seeds, place, step, rng)
    return res.target()


_ROWS_KEY = ("reverse rows per sample",)  # program.checked: why f failed on one sample under vmap


def _shape_key(p: Problem) -> tuple:
    return (tuple(p.in_shape), p.z.dtype, p.z.device.type)


def _rows_per_sample(p: Problem) -> bool:
    """Broadcast reverse mode as ``vmap`` over samples of ``vjp`` (``sample_rows``): for a captured
    graph (samples independent, every op has a rule) of a one-argument f, without random layers,
    outside torch.func transforms, unless f failed on one sample before."""
    return (p.row_fn is not None and p.program is not None and not p.random and not in_transform()
            and p.n_out > 1 and p.n_in > 1  # else the rows (k, B, D) are already (B, Y, D) in memory
            and _ROWS_KEY + _shape_key(p) not in p.program.checked)


Layout = tuple[Callable[[int, int], Tensor], Callable[[int, int, Tensor], None]]


def _whole_batch_functional(p: Problem, plan: Plan, engine: Callable[..., None], res: _Result,
                            rng: Optional[RngReplay]) -> Tensor:
    """The whole-batch strategy without indexed writes into a preallocated result: inside torch.func
    transforms (vmap) such writes of batched blocks fail or lose the vmap dimension (found by the
    differential harness: wrong numbers under vmap with structure='coupled'). Direction j runs over
    (b, d) or (b, y) in order, so the kept rows, concatenated, are the result in that order."""
    forward = plan.mode == "forward"
    seeds, _ = _SEEDS[("whole-batch", forward, p.kind == "params")](p, res, plan.directions)
    rows: list[Tensor] = []
    inner = p.n_in if forward else p.n_out

    def keep(s: int, e: int, blk: Tensor) -> None:
        if p.kind == "params":  # parameters are shared: the product is the whole row (B*Y, P)
            rows.append(blk)
            return
        b = torch.arange(s, e, device=blk.device) // inner
        rows.append(blk[torch.arange(e - s, device=blk.device), b])  # (k, Y) forward, (k, D) reverse

    engine(p.fn, p.z, plan.directions, seeds, keep, plan.chunk_size, rng)
    flat = torch.cat(rows)
    if p.kind == "params":
        value = flat.reshape(res.shape)
    elif forward:  # rows j = b * D + d hold column d of block b
        value = flat.reshape(p.batch, p.n_in, p.n_out).transpose(1, 2)
    else:  # rows j = b * Y + y hold row y of block b
        value = flat.reshape(p.batch, p.n_out, p.n_in)
    return res.out.copy_(value) if res.out is not None else value


def _broadcast_forward(p: Problem, res: _Result, n: int) -> Layout:
    # tangents (k, B, D): e_d on every sample; products (k, B, Y) are columns d of every block.
    def seeds(s: int, e: int) -> Tensor:
        return one_hot(s, e, p.n_in, p.z).unsqueeze(1).expand(e - s, p.batch, p.n_in)

    def place(s: int, e: int, blk: Tensor) -> None:
        blk = blk.permute(1, 2, 0)
        if not (s == 0 and e == n and res.whole(blk)):
            res.put((slice(None), slice(None), slice(s, e)), blk)

    return seeds, place


def _broadcast_reverse(p: Problem, res: _Result, n: int) -> Layout:
    # cotangents (k, B, Y): e_y on every sample; products (k, B, D) are rows y of every block.
    def seeds(s: int, e: int) -> Tensor:
        return one_hot(s, e, p.n_out, p.z).unsqueeze(1).expand(e - s, p.batch, p.n_out)

    def place(s: int, e: int, blk: Tensor) -> None:
        blk = blk.transpose(0, 1)
        if not (s == 0 and e == n and res.whole(blk)):
            res.put((slice(None), slice(s, e)), blk)

    return seeds, place


def _whole_batch_forward(p: Problem, res: _Result, n: int) -> Layout:
    # inputs: tangent j = e_(b, d) with b, d = divmod(j, D); keep row b of its product.
    def seeds(s: int, e: int) -> Tensor:
        return one_hot(s, e, n, p.z).view(e - s, p.batch, p.n_in)

    def place(s: int, e: int, blk: Tensor) -> None:
        j = torch.arange(s, e, device=blk.device)
        b, d = j // p.n_in, j % p.n_in
        res.put((b, slice(None), d), blk[torch.arange(e - s, device=blk.device), b])

    return seeds, place


def _whole_batch_reverse(p: Problem, res: _Result, n: int) -> Layout:
    # cotangent j = e_(b, y) with b, y = divmod(j, Y); inputs keep row b of the product.
    def seeds(s: int, e: int) -> Tensor:
        return one_hot(s, e, n, p.z).view(e - s, p.batch, p.n_out)

    def place(s: int, e: int, blk: Tensor) -> None:
        j = torch.arange(s, e, device=blk.device)
        b, y = j // p.n_out, j % p.n_out
        if p.kind == "params":  # parameters are shared: the product is the whole row
            res.put(slice(s, e), blk, view=(-1, p.n_in))
        else:
            res.put((b, y), blk[torch.arange(e - s, device=blk.device), b])

    return seeds, place


def _params_forward(p: Problem, res: _Result, n: int) -> Layout:
    # tangent e_p on the shared parameters: its product (k, B, Y) is column p of every sample.
    def seeds(s: int, e: int) -> Tensor:
        return one_hot(s, e, p.n_in, p.z)

    def place(s: int, e: int, blk: Tensor) -> None:
        blk = blk.permute(1, 2, 0) if p.batched else blk.transpose(0, 1)
        if not (s == 0 and e == n and res.whole(blk)):
            res.put((Ellipsis, slice(s, e)), blk)

    return seeds, place


def _full_forward(p: Problem, res: _Result, n: int) -> Layout:
    def seeds(s: int, e: int) -> Tensor:
        return one_hot(s, e, p.n_in, p.z)

    def place(s: int, e: int, blk: Tensor) -> None:
        blk = blk.transpose(0, 1)
        if not (s == 0 and e == n and res.whole(blk)):
            res.put((slice(None), slice(s, e)), blk)

    return seeds, place


def _full_reverse(p: Problem, res: _Result, n: int) -> Layout:
    def seeds(s: int, e: int) -> Tensor:
        return one_hot(s, e, p.n_out, p.z)

    def place(s: int, e: int, blk: Tensor) -> None:
        if not (s == 0 and e == n and res.whole(blk)):
            res.put(slice(s, e), blk)

    return seeds, place


# (strategy, forward?, parameters?) -> layout builder
_SEEDS = {
    ("broadcast", True, False): _broadcast_forward,
    ("broadcast", False, False): _broadcast_reverse,
    ("whole-batch", True, False): _whole_batch_forward,
    ("whole-batch", False, False): _whole_batch_reverse,
    ("whole-batch", True, True): _params_forward,
    ("whole-batch", False, True): _whole_batch_reverse,
    ("full", True, False): _full_forward,
    ("full", False, False): _full_reverse,
    ("full", True, True): _params_forward,
    ("full", False, True): _full_reverse,
}
