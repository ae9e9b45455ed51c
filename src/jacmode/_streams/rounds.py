"""Run a computation over the batches of a data set, round by round, on one rank or many.

NOTE: [Rounds]
Each rank takes its next batch (see ``batches.py`` for the split) and computes it. For
per-sample results all ranks then share one status row (``all_gather`` of a few integers):
which batch, which rows, done or failed, and gather the rows (every rank receives every rank's
rows). So a failure on any rank stops every rank at the same round with a :class:`BatchError`
naming the batch, instead of leaving the others waiting, and rank 0's bar counts every rank's
samples. Sums need no step in lockstep: each rank adds its batches alone (a collective per
batch made 2 ranks slower than 1 on a busy machine, as every wait for the slower rank adds
up), then one status exchange, so that a failure on one rank raises on all, and one
``all_reduce``. Without a process group there are no collectives and a round is one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from torch import Tensor

from .._errors import BatchError
from . import collective
from .batches import LocalPieces, Piece, check_split, total_samples
from .progress import progress_bar


@dataclass
class Done:
    """A computed batch: its rows (``start``, ``step``, ``count``) and its per-sample value."""

    start: int
    step: int
    count: int
    value: Optional[Tensor]


def run_rounds(batches: Iterable[Any], compute: Callable[[Piece], Optional[Tensor]], *,
               gather: bool, progress: Optional[bool], desc: str,
               seen_like: Optional[dict[str, Any]] = None) -> Iterator[list[Done]]:
    """Yield, per round, the batches computed in it (every rank's when ``gather``; else own).

    ``seen_like`` (a dict), if given, receives under "like" the dtype and shape of the values
    some rank computed, so that a rank without batches can join a sum with zeros.
    """
    world, rank = collective.world()
    check_split(batches, world, rank)
    pieces = LocalPieces(batches, world, rank)
    bar = progress_bar(progress, total_samples(batches), desc, rank)
    last: Optional[Tensor] = None  # a value of this rank, for the shape in the final row
    try:
        while True:
            piece: Optional[Piece] = None
            value: Optional[Tensor] = None
            error: Optional[BaseException] = None
            try:
                piece = next(pieces, None)
                if piece is not None and piece.count:
                    value = compute(piece)
            except Exception as err:  # reported with the batch index, on every rank
                error = err
            index = piece.index if piece is not None else pieces.loading
            if world == 1 and error is not None:
                raise BatchError(index, 0, f"{type(error).__name__}: {error}") from error
            if world == 1 or not gather:  # no collective per round (sums: one at the end)
                if error is not None or piece is None:
                    break
                last = value if value is not None else last
                bar.update(piece.count * world)  # rank 0's share, scaled, while ranks work apart
                yield [Done(piece.start, piece.step, piece.count, value)]
                continue
            status = (collective.FAILED if error is not None
                      else collective.IDLE if piece is None else collective.OK)
            row = collective.status_row(status, index, piece.start if piece else 0,
                                        piece.step if piece else 1,
                                        piece.count if piece else 0, value)
            table = collective.exchange(row, error)
            if all(r[0] == collective.IDLE for r in table):
                return
            bar.update(sum(r[4] for r in table if r[0] == collective.OK))
            yield [Done(r[2], r[3], r[4], v) for r, v in collective.gather(table, value)]
        if world > 1:  # sums: one status exchange, so a failure anywhere raises everywhere
            row = collective.status_row(collective.FAILED if error is not None else collective.IDLE,
                                        index, 0, 1, 0, last)
            table = collective.exchange(row, error)
            if seen_like is not None:
                seen_like["like"] = collective.like(table)
    finally:
        bar.close()
