"""Collect results over a data set: rows into ``out=`` or a new tensor, or one sum."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

from .._errors import BatchError, JacmodeWarning
from . import collective
from .batches import Piece, rows
from .pages import FileWriter, file_region, release
from .rounds import Done, run_rounds


def into(out: Tensor, batches: Iterable[Any], compute: Callable[[Piece, Optional[Tensor]], Tensor],
         progress: Optional[bool], desc: str) -> None:
    """Write per-sample results into ``out`` row by row; say which rows are final on failure.

    In one process each batch is computed straight into its rows of ``out``, or, when ``out``
    is a memmap, into a reused buffer written to the file (see ``pages.py``).
    """
    world, _ = collective.world()
    region = file_region(out)
    writer = FileWriter(out, region) if region is not None else None
    written = 0

    def run(piece: Piece) -> Tensor:
        if piece.start + piece.step * (piece.count - 1) >= len(out):
            raise ValueError(f"out: has {len(out)} rows but the data set has more samples "
                             f"(batch {piece.index} reaches row {piece.start + piece.count - 1}). "
                             "Allocate one row per sample.")
        if world > 1 or piece.x.device != out.device:  # gathered, or a GPU model and CPU out=
            return compute(piece, None)
        if writer is None:
            return compute(piece, out[piece.start: piece.start + piece.count])
        return compute(piece, writer.buffer(piece.count))

    try:
        for done in run_rounds(batches, run, gather=world > 1, progress=progress, desc=desc):
            for d in done:
                if d.value is None:
                    continue
                value = d.value.to(out.device)
                if writer is not None and d.step == 1:
                    writer.write(d.start, value)
                else:
                    view = out[rows(d.start, d.step, d.count)]
                    if value.data_ptr() != view.data_ptr():
                        view.copy_(value)
                    if region is not None:
                        release(view)
                written = max(written, d.start + d.step * (d.count - 1) + 1)
    except BatchError as err:
        err.rows_written = written
        raise
    finally:
        if writer is not None:
            writer.close()
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
