"""Colouring: partition columns (forward), rows (reverse) or a symmetric Hessian's columns (star).

NOTE: [Colourings]
* **column** (forward mode): columns j, k may share a colour when no row has a nonzero in both
  (structurally orthogonal), i.e. a distance-2 colouring of the bipartite graph, or a distance-1
  colouring of the column intersection graph J^T J. One jvp per colour with the tangent
  sum_{j in colour} e_j gives every column: J[i, j] = (J V)[i, colour(j)].
* **row** (reverse mode): the same on J^T, one vjp per colour.
* **star** (symmetric Hessians, Gebremedhin, Manne, Pothen 2005): a distance-1 colouring of the
  adjacency graph of H in which every path on four vertices uses at least three colours. Then for
  every nonzero H[i, j] either colour(j) appears only once among the neighbours of i (read it at
  (H V)[i, colour(j)]) or colour(i) appears only once among those of j (read H[j, i] instead):
  fewer colours than a column colouring, because symmetry gives each entry two chances.

Greedy colouring in a vertex order: take the vertices in turn, give each the smallest colour none
of its (relevant) neighbours has. Orders: "natural", "largest_first" (by degree), "smallest_last"
(Matula and Beck: repeatedly remove a vertex of smallest degree, colour in reverse removal order)
"incidence" (columns by the first row they touch) and "fields" (x read as F fields of equal
size, the leading dimension of x when it has several, else F = 2, 3, 4: the F variables of each
grid point in turn, the order that colours the 2-D Brusselator with 8 colours where the others
need 11-12). "best" tries every order and keeps the fewest colours.
The lower bound is the largest number of nonzeros in one row (columns), column (rows) or row of H.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .pattern import SparsityPattern
from .sets import unique

ORDERS = ("natural", "largest_first", "smallest_last", "incidence", "fields")
PARTITIONS = ("auto", "column", "row", "star")
ADJACENCY_CAP = 50_000_000  # entries of the intersection graph before a partition counts as hopeless


@dataclass(frozen=True, repr=False, eq=False)
class Coloring:
    """A partition of the columns (or rows) of a sparsity pattern into structurally orthogonal groups.

    Attributes:
        partition: "column" (forward mode, one jvp per colour), "row" (reverse mode, one vjp per
            colour) or "star" (symmetric Hessian, one Hessian-vector product per colour).
        colors: (N,) int64 NumPy array for "column"/"star", (Y,) for "row": the colour of each.
        n_colors: the number of colours (of directions to push).
        lower_bound: the most nonzeros in one row (column colouring), one column (row colouring)
            or one row of the Hessian (star): no valid colouring has fewer colours.
        order: the vertex order that produced it.
        pattern: the pattern it colours.
    """

    partition: str
    colors: np.ndarray
    n_colors: int
    lower_bound: int
    order: str
    pattern: SparsityPattern

    def groups(self) -> list[np.ndarray]:
        """The members of each colour, sorted."""
        order = np.argsort(self.colors, kind="stable")
        counts = np.bincount(self.colors, minlength=self.n_colors)
        return np.split(order, np.cumsum(counts)[:-1])

    def __repr__(self) -> str:
        return (f"Coloring({self.partition}, {self.n_colors} colours, lower bound {self.lower_bound}, "
                f"order {self.order!r})")


def intersection_graph(p: SparsityPattern) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """CSR (ptr, adj) of the column intersection graph (columns sharing a row), without loops.

    None when it would hold more than ``ADJACENCY_CAP`` entries (a dense row).
    """
    lens = p.row_counts()
    per = np.repeat(lens, lens)  # for every nonzero, the length of its row
    if int(per.sum()) > ADJACENCY_CAP:
        return None
    a = np.repeat(p.col, per)
    starts = np.repeat(np.repeat(p.crow[:-1], lens), per)
    offs = np.arange(a.shape[0], dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    b = p.col[starts + offs]
    n = p.shape[1]
    keys = unique(a * n + b)
    keys = keys[keys // n != keys % n]
    src = keys // n
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=ptr[1:])
    return ptr, keys - src * n


def adjacency(p: SparsityPattern) -> tuple[np.ndarray, np.ndarray]:
    """CSR (ptr, adj) of the symmetric pattern's graph, without loops."""
    rows = p.rows()
    keep = rows != p.col
    ptr = np.zeros(p.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows[keep], minlength=p.shape[0]), out=ptr[1:])
    return ptr, p.col[keep]


def _field_orders(n: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    if len(shape) >= 2 and 1 < shape[0] <= 8:
        fields = [shape[0]]
    else:
        fields = [k for k in (2, 3, 4) if n % k == 0 and n > k]
    return [np.arange(n, dtype=np.int64).reshape(k, -1).T.reshape(-1) for k in fields]


def vertex_orders(order: str, ptr: np.ndarray, adj: np.ndarray, p: SparsityPattern) -> list[np.ndarray]:
    """The candidate vertex orders named ``order`` (several for "fields")."""
    n = ptr.shape[0] - 1
    deg = np.diff(ptr)
    if order == "fields":
        return _field_orders(n, p.in_shape)
    return [_one_order(order, n, deg, ptr, adj, p)]


def _one_order(order: str, n: int, deg: np.ndarray, ptr: np.ndarray, adj: np.ndarray,
               p: SparsityPattern) -> np.ndarray:
    if order == "natural":
        return np.arange(n, dtype=np.int64)
    if order == "largest_first":
        return np.argsort(-deg, kind="stable")
    if order == "incidence":
        t = p.transpose()  # rows sorted within each column: the first is the smallest
        first = np.where(np.diff(t.crow) > 0, t.col[np.minimum(t.crow[:-1], max(t.nnz - 1, 0))], n)
        return np.lexsort((np.arange(n), first))
    return _smallest_last(ptr, adj)


def _smallest_last(ptr: np.ndarray, adj: np.ndarray) -> np.ndarray:
    n = ptr.shape[0] - 1
    deg = np.diff(ptr).tolist()
    P, A = ptr.tolist(), adj.tolist()
    top = max(deg, default=0)
    buckets: list[set[int]] = [set() for _ in range(top + 1)]
    for v, d in enumerate(deg):
        buckets[d].add(v)
    removed = [False] * n
    out: list[int] = []
    low = 0
    for _ in range(n):
        low = max(low - 1, 0)
        while not buckets[low]:
            low += 1
        v = buckets[low].pop()
        removed[v] = True
        out.append(v)
        for w in A[P[v]:P[v + 1]]:
            if not removed[w]:
                d = deg[w]
                buckets[d].discard(w)
                deg[w] = d - 1
                buckets[d - 1].add(w)
    return np.asarray(out[::-1], dtype=np.int64)


def _lists(ptr: Any, adj: Any) -> tuple[list[int], list[int]]:
    return (ptr.tolist() if isinstance(ptr, np.ndarray) else ptr,
            adj.tolist() if isinstance(adj, np.ndarray) else adj)


def greedy(ptr: Any, adj: Any, order: np.ndarray) -> np.ndarray:
    """Distance-1 greedy colouring of the graph (ptr, adj) in ``order`` (arrays or lists)."""
    P, A = _lists(ptr, adj)
    n = len(P) - 1
    color = [-1] * n
    mark = [-1] * (n + 1)
    for v in order.tolist():
        for w in A[P[v]:P[v + 1]]:
            c = color[w]
            if c >= 0:
                mark[c] = v
        c = 0
        while mark[c] == v:
            c += 1
        color[v] = c
    return np.asarray(color, dtype=np.int64)


def star_greedy(ptr: Any, adj: Any, order: np.ndarray) -> np.ndarray:
    """Greedy star colouring (Gebremedhin, Manne, Pothen 2005, Algorithm 4.1).

    For vertex v: forbid the colours of its neighbours w; for every neighbour x of a neighbour w
    (x != v): if w is uncoloured forbid colour(x) (a distance-2 conflict); if w is coloured,
    forbid colour(x) when x has another neighbour y != w of colour(w) (which would close a
    two-coloured path y - x - w - v).
    """
    P, A = _lists(ptr, adj)
    n = len(P) - 1
    color = [-1] * n
    mark = [-1] * (n + 1)
    for v in order.tolist():
        for w in A[P[v]:P[v + 1]]:
            cw = color[w]
            if cw >= 0:
                mark[cw] = v
            for x in A[P[w]:P[w + 1]]:
                if x == v:
                    continue
                cx = color[x]
                if cx < 0:
                    continue
                if cw < 0:
                    mark[cx] = v
                else:
                    for y in A[P[x]:P[x + 1]]:
                        if y != w and color[y] == cw:
                            mark[cx] = v
                            break
        c = 0
        while mark[c] == v:
            c += 1
        color[v] = c
    return np.asarray(color, dtype=np.int64)


def color(p: SparsityPattern, partition: str = "column", order: str = "best") -> Coloring:
    """Colour ``p`` (see the note); ``partition`` one of "column", "row", "star"."""
    if partition == "row":
        t = p.transpose()
        same = t.shape == p.shape and np.array_equal(t.crow, p.crow) and np.array_equal(t.col, p.col)
        c = color(p if same else t, "column", order)  # structurally symmetric: the same graph
        return Coloring("row", c.colors, c.n_colors, c.lower_bound, c.order, p)
    n = p.shape[1]
    if partition == "star":
        ptr, adj = adjacency(p)
        bound = int(p.row_counts().max(initial=0))
        run = star_greedy
    else:
        graph = intersection_graph(p)
        bound = int(p.row_counts().max(initial=0))
        if graph is None:  # a dense row: every column its own colour
            return Coloring(partition, np.arange(n, dtype=np.int64), n, bound, "natural", p)
        ptr, adj = graph
        run = greedy
    best: Optional[tuple[np.ndarray, str]] = None
    lists = _lists(ptr, adj)
    for name in (ORDERS if order == "best" else (order,)):
        for candidate in vertex_orders(name, ptr, adj, p):
            colors = run(*lists, candidate)
            if best is None or colors.max(initial=-1) < best[0].max(initial=-1):
                best = (colors, name)
    if best is None:  # "fields" of a vector that does not split: natural
        best = (run(*lists, np.arange(n, dtype=np.int64)), "natural")
    colors, name = best
    return Coloring(partition, colors, int(colors.max(initial=-1)) + 1, bound, name, p)
