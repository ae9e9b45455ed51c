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

NOTE: [Bidirectional colouring]
A few dense rows force a column colouring to give every column its own colour, a few dense
columns do the same to a row colouring; with both (an arrowhead) neither side helps. A
bidirectional colouring reads some nonzeros from vjps and the others from jvps. The simple exact
scheme used here (not Coleman and Verma's star bicolouring, which also splits entries inside a
row): set the rows R apart; colour the rows of J[R, :] (row colouring, one vjp per colour, over
every column) and the columns of J[not R, :] (column colouring that ignores the rows in R). An
entry in a row of R is read from its row colour's vjp, any other from its column colour's jvp;
each colouring is structurally orthogonal on the entries it reads, so nothing is subtracted and
decompression is a gather as for one side. Symmetrically with a set of columns C read from jvps
and the rest from a row colouring that ignores C. R (C) runs over thresholds of the row (column)
degrees, largest first: the rows with at least t nonzeros; a threshold is coloured only when the
sum of both sides' lower bounds can beat the best cost so far, and the search stops once the
set-apart side alone cannot. Cost: jvps + ``REVERSE_COST`` x vjps + ``SIDE_COST`` (using both
modes runs f once more), so a bidirectional colouring is kept only where it beats both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .pattern import SparsityPattern
from .sets import unique

ORDERS = ("natural", "largest_first", "smallest_last", "incidence", "fields")
PARTITIONS = ("auto", "column", "row", "star", "bidirectional")
REVERSE_COST = 1.5  # one vjp pass in units of one jvp pass (as the dense cost model)
SIDE_COST = 1.0  # a bidirectional evaluation runs both modes: one pass more than one side
THRESHOLDS = 24  # degree thresholds tried per side
ADJACENCY_CAP = 50_000_000  # entries of the intersection graph before a partition counts as hopeless


@dataclass(frozen=True, repr=False, eq=False)
class Coloring:
    """A partition of the columns (or rows) of a sparsity pattern into structurally orthogonal groups.

    Attributes:
        partition: "column" (forward mode, one jvp per colour), "row" (reverse mode, one vjp per
            colour), "star" (symmetric Hessian, one Hessian-vector product per colour) or
            "bidirectional" (some nonzeros from jvps of column colours, the others from vjps of
            row colours; see the note in ``coloring.py``).
        colors: (N,) int64 NumPy array for "column"/"star"/"bidirectional", (Y,) for "row": the
            colour of each (-1 for a column no jvp needs, "bidirectional" only).
        n_colors: the number of colours (of directions to push; both sides for "bidirectional").
        lower_bound: the most nonzeros in one row (column colouring), one column (row colouring)
            or one row of the Hessian (star): no valid colouring has fewer colours. For
            "bidirectional", the sum of both sides' bounds for its split of the nonzeros.
        order: the vertex order that produced it ("forward/reverse" for "bidirectional").
        pattern: the pattern it colours.
        row_colors: "bidirectional" only: (Y,) the row colour of each row read from vjps, -1 for
            the others.
        from_rows: "bidirectional" only: (nnz,) bool in the pattern's CSR order, True for the
            nonzeros read from the vjps.
    """

    partition: str
    colors: np.ndarray
    n_colors: int
    lower_bound: int
    order: str
    pattern: SparsityPattern
    row_colors: Optional[np.ndarray] = None
    from_rows: Optional[np.ndarray] = None

    @property
    def n_column_colors(self) -> int:
        """Colours pushed forward (jvps): all of them for "column"/"star", none for "row"."""
        if self.partition == "bidirectional":
            return int(self.colors.max(initial=-1)) + 1
        return 0 if self.partition == "row" else self.n_colors

    @property
    def n_row_colors(self) -> int:
        """Colours pulled back (vjps): all of them for "row", none for "column"/"star"."""
        if self.partition == "bidirectional":
            assert self.row_colors is not None  # set with the partition, not user input
            return int(self.row_colors.max(initial=-1)) + 1
        return self.n_colors if self.partition == "row" else 0

    def groups(self) -> list[np.ndarray]:
        """The members of each colour of ``colors``, sorted (the columns' side for "bidirectional")."""
        used = np.flatnonzero(self.colors >= 0)
        order = used[np.argsort(self.colors[used], kind="stable")]
        counts = np.bincount(self.colors[used], minlength=int(self.colors.max(initial=-1)) + 1)
        return np.split(order, np.cumsum(counts)[:-1])

    def __repr__(self) -> str:
        sides = (f" ({self.n_column_colors} jvps + {self.n_row_colors} vjps)"
                 if self.partition == "bidirectional" else "")
        return (f"Coloring({self.partition}, {self.n_colors} colours{sides}, lower bound "
                f"{self.lower_bound}, order {self.order!r})")


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
    if order == "natural" or p.nnz == 0:
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
    """Colour ``p`` (see the notes); ``partition`` one of "column", "row", "star", "bidirectional"."""
    if partition == "bidirectional":
        split = bidirectional(p, order)
        if split is None:  # nothing to split (no nonzeros): every entry from the jvps
            c = color(p, "column", order)
            split = Coloring("bidirectional", c.colors, c.n_colors, c.lower_bound, c.order, p,
                             np.full(p.shape[0], -1, dtype=np.int64), np.zeros(p.nnz, dtype=bool))
        return split
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
        bound = int(p.row_counts().max(initial=0))
        graph = intersection_graph(p) if bound < n else None
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


def cost(c: Coloring) -> float:
    """Relative cost of evaluating with ``c``: passes, a vjp pass counting ``REVERSE_COST``."""
    if c.partition == "bidirectional":
        both = c.n_column_colors > 0 and c.n_row_colors > 0
        return c.n_column_colors + REVERSE_COST * c.n_row_colors + (SIDE_COST if both else 0.0)
    return c.n_colors * (REVERSE_COST if c.partition == "row" else 1.0)


def keep_rows(p: SparsityPattern, keep: np.ndarray) -> SparsityPattern:
    """``p`` with the rows outside ``keep`` ((Y,) bool) emptied; same shape."""
    counts = np.where(keep, p.row_counts(), 0)
    crow = np.zeros(p.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=crow[1:])
    return SparsityPattern(p.shape, crow, p.col[np.repeat(keep, p.row_counts())], p.in_shape, p.out_shape)


def bidirectional(p: SparsityPattern, order: str = "best", beat: float = float("inf")) -> Optional[Coloring]:
    """The cheapest bidirectional colouring of ``p`` (see the note) costing less than ``beat``, or None."""
    found: Optional[tuple[float, Coloring]] = None
    one_sided = math.isinf(beat)  # else the caller has the one-sided colourings already
    t = p.transpose()
    for side in ("rows", "columns"):
        q, w_apart, w_rest = (p, REVERSE_COST, 1.0) if side == "rows" else (t, 1.0, REVERSE_COST)
        best = beat if found is None else min(beat, found[0])
        split = _rows_apart(q, order, best, w_apart, w_rest, one_sided)
        if split is None:
            continue
        total, apart, apart_colors, rest_colors, lb, name = split
        if side == "rows":
            rev, fwd = name.split("/")
            c = Coloring("bidirectional", rest_colors, 0, lb, f"{fwd}/{rev}", p, apart_colors,
                         np.repeat(apart, p.row_counts()))
        else:  # q = p^T: its rows apart are p's columns read from jvps
            c = Coloring("bidirectional", apart_colors, 0, lb, name, p, rest_colors, ~apart[p.col])
        c = Coloring(c.partition, c.colors, c.n_column_colors + c.n_row_colors, c.lower_bound, c.order,
                     p, c.row_colors, c.from_rows)
        found = (total, c)
    return None if found is None else found[1]


def _rows_apart(q: SparsityPattern, order: str, beat: float, w_apart: float, w_rest: float,
                one_sided: bool) -> Optional[tuple[float, np.ndarray, np.ndarray, np.ndarray, int, str]]:
    """The best split of ``q`` into rows set apart (row colouring, weight ``w_apart`` per colour)
    and the rest (column colouring ignoring them, ``w_rest``) over thresholds of the row degrees;
    every row apart (a one-sided colouring) only when ``one_sided``."""
    deg = q.row_counts()
    levels = np.unique(deg[deg > 0])[::-1]
    if levels.shape[0] > THRESHOLDS:  # the densest levels, then halving degrees
        top = int(levels[0])
        halves = [top >> k for k in range(1, 40) if top >> k]
        levels = np.unique(np.concatenate([levels[:THRESHOLDS // 2], [v for v in halves if v > 0]]))[::-1]
    rows = np.repeat(np.arange(q.shape[0]), deg)
    found = None
    for level in levels.tolist():
        apart = deg >= level
        rest_bound = int(deg[~apart].max(initial=0))
        apart_bound = int(np.bincount(q.col[apart[rows]], minlength=1).max(initial=0))
        if w_apart * apart_bound >= beat or (rest_bound == 0 and not one_sided):
            break  # the set-apart side only grows with the set
        if w_apart * apart_bound + w_rest * rest_bound + SIDE_COST * (rest_bound > 0) >= beat:
            continue
        rc = color(keep_rows(q, apart), "row", order)
        cc = color(keep_rows(q, ~apart), "column", order)
        apart_colors = np.where(apart, rc.colors, -1)
        needed = np.zeros(q.shape[1], dtype=bool)
        needed[q.col[~apart[rows]]] = True
        rest_colors = np.where(needed, cc.colors, -1)
        n_apart, n_rest = int(apart_colors.max(initial=-1)) + 1, int(rest_colors.max(initial=-1)) + 1
        total = w_apart * n_apart + w_rest * n_rest + (SIDE_COST if n_apart and n_rest else 0.0)
        if total < beat:
            beat = total
            found = (total, apart, apart_colors, rest_colors, apart_bound + rest_bound,
                     f"{rc.order}/{cc.order}")
    return found
