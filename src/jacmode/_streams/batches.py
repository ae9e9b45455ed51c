"""Batches of a data set: unpack ``x`` or ``(x, y)``, split them by rank, place their rows.

NOTE: [Rows of the one-process result]
Every sample gets the row it would have if one process iterated the data: a running count of
samples. Two ways to split the data over R ranks, both giving each sample exactly one rank:

- a ``DataLoader`` with a ``DistributedSampler`` (the convention of distributed training): the
  sampler already gave rank r positions r, r + R, r + 2R, ... of its global order, so the
  j-th sample on rank r lands in row r + R * j. The sampler pads the data to a multiple of R
  by repeating samples; rows >= len(dataset) are those repeats and are dropped here, so sums
  count every sample once. With ``shuffle=False`` the row is the sample's index in the data set.
- any other iterable: rank r keeps batches r, r + R, ... (rank-strided), so rows are contiguous
  per batch. Every rank reads every batch to learn its offset, except from a map-style
  ``DataLoader``, whose batch sampler gives every batch's indices without loading anything: then
  each rank loads only its own batches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Piece:
    """One batch as this rank computes it: rows ``start, start + step, ...`` (``count`` of them)."""

    index: int
    x: Tensor
    y: Optional[Tensor]
    start: int
    step: int
    item: Any = None  # the batch as the data set yielded it (its rows dropped as x's are), for f(*item[:k])

    @property
    def count(self) -> int:
        return len(self.x)


def unpack(item: Any, index: int) -> tuple[Tensor, Optional[Tensor]]:
    """``x`` or ``(x, y, ...)`` as a DataLoader yields it -> ``(x, y or None)``."""
    if isinstance(item, Tensor):
        return item, None
    if isinstance(item, (tuple, list)) and item and isinstance(item[0], Tensor):
        y = item[1] if len(item) > 1 else None
        if y is not None and not isinstance(y, Tensor):
            raise TypeError(f"batches: item {index} is a tuple whose second entry is "
                            f"{type(y).__name__}, expected a tensor of targets y. Yield x or (x, y).")
        if y is not None and len(y) != len(item[0]):
            raise ValueError(f"batches: item {index} has {len(item[0])} inputs but {len(y)} "
                             "targets; x and y must have the same length along dim 0.")
        return item[0], y
    raise TypeError(f"batches: item {index} is {type(item).__name__}, expected a tensor x or a "
                    "tuple (x, y) of tensors, as a DataLoader over a TensorDataset yields.")


def distributed_sampler(batches: Iterable[Any]) -> Optional[DistributedSampler]:
    """The ``DistributedSampler`` of a DataLoader, if it has one."""
    if not isinstance(batches, DataLoader):
        return None
    for sampler in (batches.sampler, getattr(batches.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def check_split(batches: Iterable[Any], world: int, rank: int) -> None:
    """A split by rank must give every sample to exactly one rank (see the NOTE above)."""
    sampler = distributed_sampler(batches)
    if sampler is not None and (sampler.num_replicas, sampler.rank) != (world, rank):
        raise ValueError(
            f"batches: the DataLoader's DistributedSampler has num_replicas={sampler.num_replicas}, "
            f"rank={sampler.rank}, but this process is rank {rank} of {world}. Build the sampler "
            "after init_process_group with its defaults, or drop it."
        )
    if sampler is None and world > 1 and isinstance(batches, DataLoader) and isinstance(
            batches.sampler, RandomSampler):
        raise ValueError(
            "batches: a shuffling DataLoader yields a different order on every rank, so ranks "
            "would split the data wrongly. Use shuffle=False, or "
            "DistributedSampler(dataset, shuffle=True, seed=...) as the sampler."
        )


class LocalPieces:
    """The batches this rank computes, each with the rows of its samples (an iterator).

    ``loading`` is the index of the batch being read, to report a batch whose loading fails.
    """

    def __init__(self, batches: Iterable[Any], world: int, rank: int) -> None:
        self.loading = 0
        self._it = self._pieces(batches, world, rank)

    def __iter__(self) -> "LocalPieces":
        return self

    def __next__(self) -> Piece:
        return next(self._it)

    def _items(self, batches: Iterable[Any], names: Optional[list[int]] = None,
               ) -> Iterator[tuple[int, Tensor, Optional[Tensor], Any]]:
        """(index, x, y) per batch; ``names`` maps local positions to one-process indices."""
        it = iter(batches)
        for k in itertools.count():
            self.loading = k if names is None else names[min(k, len(names) - 1)]
            try:
                item = next(it)
            except StopIteration:
                return
            x, y = unpack(item, self.loading)
            yield self.loading, x, y, item

    def _pieces(self, batches: Iterable[Any], world: int, rank: int) -> Iterator[Piece]:
        sampler = distributed_sampler(batches)
        if sampler is not None and world > 1:
            n, done = len(sampler.dataset), 0  # type: ignore[arg-type]
            for i, x, y, item in self._items(batches):
                keep = max(0, min(len(x), -(-(n - rank - world * done) // world)))  # drop padding
                kept = type(item)(v[:keep] if isinstance(v, Tensor) else v for v in item) \
                    if isinstance(item, (tuple, list)) else item[:keep]
                yield Piece(i, x[:keep], None if y is None else y[:keep], rank + world * done, world, kept)
                done += len(x)
            return
        own = own_batches(batches, world, rank) if world > 1 else None
        if own is not None:  # a map-style DataLoader: load only this rank's batches
            loader, names, offsets = own
            for k, (i, x, y, item) in enumerate(self._items(loader, names)):
                yield Piece(i, x, y, offsets[k], 1, item)
            return
        offset = 0
        for i, x, y, item in self._items(batches):
            if i % world == rank:
                yield Piece(i, x, y, offset, 1, item)
            offset += len(x)


def own_batches(batches: Iterable[Any], world: int, rank: int,
                ) -> Optional[tuple[DataLoader, list[int], list[int]]]:
    """For a map-style DataLoader: a loader of batches rank, rank + R, ... only, their indices
    in the one-process order and their first rows, from the batch sampler (nothing loaded)."""
    if not isinstance(batches, DataLoader) or isinstance(batches.dataset, IterableDataset) \
            or batches.batch_sampler is None:
        return None
    index_lists = [list(idx) for idx in batches.batch_sampler]
    offsets = [0, *itertools.accumulate(len(idx) for idx in index_lists)]
    names = list(range(rank, len(index_lists), world))
    extra: dict[str, Any] = {}
    if batches.num_workers > 0:
        extra = dict(prefetch_factor=batches.prefetch_factor,
                     persistent_workers=batches.persistent_workers,
                     multiprocessing_context=batches.multiprocessing_context,
                     worker_init_fn=batches.worker_init_fn)
    loader = DataLoader(batches.dataset, batch_sampler=[index_lists[i] for i in names],
                        collate_fn=batches.collate_fn, num_workers=batches.num_workers,
                        pin_memory=batches.pin_memory, timeout=batches.timeout, **extra)
    return loader, names, [offsets[i] for i in names]


def total_samples(batches: Iterable[Any]) -> Optional[int]:
    """Samples in the whole data set when it is known without iterating (for progress bars)."""
    if isinstance(batches, DataLoader):
        try:
            return len(batches.dataset)  # type: ignore[arg-type]
        except TypeError:
            return None
    if isinstance(batches, (list, tuple)):
        try:
            return sum(len(unpack(item, i)[0]) for i, item in enumerate(batches))
        except (TypeError, ValueError):
            return None
    return None


def rows(piece_start: int, piece_step: int, count: int) -> slice:
    """The rows of a piece as a slice of the result (a view: strided when step > 1)."""
    return slice(piece_start, piece_start + piece_step * (count - 1) + 1 if count else piece_start,
                 piece_step)
