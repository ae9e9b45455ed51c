"""Index sets, one per tensor element, stored as CSR arrays: the algebra that pattern rules use.

NOTE: [Index sets as CSR]
A tensor t met while tracing ``f`` carries, for each of its elements (flattened, row-major), the
sorted set of input indices it depends on: ``Rows(ptr, idx)`` with the set of element e in
``idx[ptr[e]:ptr[e + 1]]`` (NumPy int64). Every rule is one of two moves on these arrays, both
vectorised:

* ``gather(rows, src)``: element e of the result takes the set of element ``src[e]`` (-1: empty).
  Shape ops, indexing, padding, broadcasting are gathers; no sort is needed.
* ``pull(rows, dst, src, m)``: the union, over pairs k, of set ``src[k]`` into result element
  ``dst[k]``. Reductions, matmul and convolution are pulls; ``union`` of several tensors' sets
  (elementwise ops with several inputs) is a pull too. Unions sort the keys ``row * n + col`` once.

A dense boolean N x N pattern for N = 32,768 would take 1 GB; these arrays take the nonzeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from typing_extensions import TypeAlias

Index: TypeAlias = np.ndarray


@dataclass(frozen=True)
class Rows:
    """One index set per element: element e depends on inputs ``idx[ptr[e]:ptr[e + 1]]``."""

    ptr: Index  # (m + 1,) int64
    idx: Index  # (nnz,) int64, sorted within each row

    @property
    def m(self) -> int:
        return int(self.ptr.shape[0] - 1)

    @property
    def nnz(self) -> int:
        return int(self.idx.shape[0])

    def lengths(self) -> Index:
        return np.diff(self.ptr)

    def row_ids(self) -> Index:
        """The row of every stored entry, (nnz,)."""
        return np.repeat(np.arange(self.m, dtype=np.int64), self.lengths())


def identity(n: int) -> Rows:
    """Element i depends on input i alone: the input itself."""
    ar = np.arange(n, dtype=np.int64)
    return Rows(np.arange(n + 1, dtype=np.int64), ar)


def empty(m: int) -> Rows:
    return Rows(np.zeros(m + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _spans(ptr: Index, src: Index) -> tuple[Index, Index]:
    """Lengths of rows ``src`` and the positions in ``idx`` of their entries, concatenated."""
    lens = ptr[src + 1] - ptr[src]
    total = int(lens.sum())
    if total == 0:
        return lens, np.zeros(0, dtype=np.int64)
    starts = np.repeat(ptr[src] - (np.cumsum(lens) - lens), lens)
    return lens, starts + np.arange(total, dtype=np.int64)


def gather(rows: Rows, src: Index) -> Rows:
    """Result element e takes the set of ``src[e]``; ``src[e] < 0`` gives the empty set."""
    src = np.asarray(src, dtype=np.int64)
    valid = src >= 0
    safe = np.where(valid, src, 0)
    lens, pos = _spans(rows.ptr, safe)
    if not valid.all():
        lens = np.where(valid, lens, 0)
        keep = np.repeat(valid, rows.ptr[safe + 1] - rows.ptr[safe])
        pos = pos[keep]
    ptr = np.zeros(src.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    return Rows(ptr, rows.idx[pos])


def unique(keys: Index) -> Index:
    """Sorted distinct keys (a sort and a mask: faster than ``np.unique`` here)."""
    if keys.shape[0] < 2:
        return keys
    keys = np.sort(keys)
    keep = np.empty(keys.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(keys[1:], keys[:-1], out=keep[1:])
    return keys[keep]


def _from_keys(keys: Index, m: int, n: int) -> Rows:
    keys = unique(keys)
    r = keys // n
    ptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=m), out=ptr[1:])
    return Rows(ptr, keys - r * n)


def keys_of(rows: Rows, dst: Index, src: Index, n: int) -> Index:
    """The keys ``dst[k] * n + col`` for every col in set ``src[k]`` (unsorted)."""
    lens, pos = _spans(rows.ptr, np.asarray(src, dtype=np.int64))
    return np.repeat(np.asarray(dst, dtype=np.int64) * n, lens) + rows.idx[pos]


def pull(rows: Rows, dst: Index, src: Index, m: int, n: int) -> Rows:
    """Result element ``dst[k]`` gets the union of the sets ``src[k]``; m result elements."""
    return _from_keys(keys_of(rows, dst, src, n), m, n)


def union(parts: Sequence[Rows], n: int) -> Rows:
    """Element-by-element union of sets of the same number of elements."""
    distinct: list[Rows] = []
    for p in parts:
        if p.nnz and not any(p is q for q in distinct):
            distinct.append(p)
    parts = distinct
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return empty(0)
    m = parts[0].m
    keys = np.concatenate([p.row_ids() * n + p.idx for p in parts])
    return _from_keys(keys, m, n)


# --- second order: pairs (i, j) of inputs, stored as sorted keys i * n + j (both orders) ---


def pairs_within(rows: Rows, n: int, cap: int) -> Optional[Index]:
    """Keys of S x S for every set S (the Hessian of a nonlinear function of one element).

    None when there would be more than ``cap`` pairs (the caller treats that as dense).
    """
    lens = rows.lengths()
    reps = lens * lens
    if int(reps.sum()) > cap:
        return None
    a = np.repeat(rows.idx, np.repeat(lens, lens))
    starts = np.repeat(rows.ptr[:-1], lens)  # row start of every entry
    per = np.repeat(lens, lens)
    offs = np.arange(a.shape[0], dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    b = rows.idx[np.repeat(starts, per) + offs]
    return unique(a * n + b)


def pairs_across(a: Rows, b: Rows, n: int, cap: int) -> Optional[Index]:
    """Keys of A_e x B_e and B_e x A_e for every element e (the Hessian of a product)."""
    la, lb = a.lengths(), b.lengths()
    if int((la * lb).sum()) > cap:
        return None
    ia = np.repeat(a.idx, np.repeat(lb, la))  # each entry of A_e repeated |B_e| times
    # partners: for every entry of A_e, the whole of B_e
    reps = np.repeat(lb, la)
    bstart = np.repeat(b.ptr[:-1], la)
    offs = np.arange(ia.shape[0], dtype=np.int64) - np.repeat(np.cumsum(reps) - reps, reps)
    ib = b.idx[np.repeat(bstart, reps) + offs]
    return unique(np.concatenate([ia * n + ib, ib * n + ia]))


def merge_keys(parts: Sequence[Optional[Index]]) -> Optional[Index]:
    """Union of key arrays; None (dense) wins."""
    if any(p is None for p in parts):
        return None
    real = [p for p in parts if p is not None and p.shape[0]]
    if not real:
        return np.zeros(0, dtype=np.int64)
    if len(real) == 1:
        return real[0]
    return unique(np.concatenate(real))
